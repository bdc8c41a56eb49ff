"""The cpu plugin's linear kernel (``cpu_native_linear``) against the definition, in numpy.

Weights float32 or bf16; the reference widens each bf16 from its bits (the top half of a float32,
written here, not taken from paddle) and accumulates in float64; the kernel accumulates in float32,
so it agrees to float32 rounding of a sum of ``K`` products.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fdplug.core.portable import ops as portable
from fdplug.plugins.cpu import kernels, native_linear

if kernels.unavailable_reason() is not None:
    pytest.skip(f"the cpu kernels do not build here: {kernels.unavailable_reason()}", allow_module_level=True)


def weight(n: int, k: int, seed: int, dtype: str = "bfloat16") -> tuple[paddle.Tensor, np.ndarray]:
    """A paddle weight ``[n, k]`` of ``dtype`` and its exact float64 values (bf16: decoded from the bits)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * np.exp(rng.uniform(-6, 3, (n, k)))).astype(np.float32)
    if dtype == "float32":
        return paddle.to_tensor(w), w.astype(np.float64)
    tensor = paddle.to_tensor(w).astype("bfloat16")
    bits = tensor.view(paddle.uint16).numpy().astype(np.uint32) << 16
    return tensor, bits.view(np.float32).astype(np.float64)


def check(x: np.ndarray, tensor: paddle.Tensor, exact: np.ndarray, threads: int = 2) -> np.ndarray:
    got = native_linear.linear(paddle.to_tensor(x), tensor, threads).numpy()
    want = x.astype(np.float64) @ exact.T
    bound = 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(exact).T) * x.shape[-1] ** 0.5 + 1e-30
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))
    return got


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("k", [1, 15, 16, 17, 100, 512, 1000])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 70])
def test_every_tail_of_rows_columns_and_depth(n, k, dtype):
    """k tails through the masked loads (k < 16 included), column tails of the 4-wide tiles, row
    tails of the 4-row tiles, pieces of columns split over threads."""
    tensor, exact = weight(n, k, seed=n * 1000 + k, dtype=dtype)
    rng = np.random.default_rng(k)
    for rows in (1, 2, 3, 4, 5, 9):
        check(rng.standard_normal((rows, k)).astype(np.float32), tensor, exact)


def test_leading_dimensions_and_empty_batches():
    tensor, exact = weight(24, 40, seed=3)
    x = np.random.default_rng(0).standard_normal((2, 3, 40)).astype(np.float32)
    got = native_linear.linear(paddle.to_tensor(x), tensor, 2).numpy()
    np.testing.assert_allclose(got, x.astype(np.float64) @ exact.T, rtol=1e-5, atol=1e-5)
    assert list(native_linear.linear(paddle.zeros([0, 40]), tensor, 2).shape) == [0, 24]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_row_is_the_same_bits_whatever_the_batch_and_the_threads(dtype):
    """Each output is one FMA chain per lane over k, summed in a fixed order: a token's result does
    not depend on the rows beside it (which tile it falls in) nor on the thread count."""
    tensor, _ = weight(300, 520, seed=5, dtype=dtype)
    rng = np.random.default_rng(6)
    batch = rng.standard_normal((11, 520)).astype(np.float32)
    together = native_linear.linear(paddle.to_tensor(batch), tensor, 2).numpy()
    for threads in (1, 3):
        np.testing.assert_array_equal(native_linear.linear(paddle.to_tensor(batch), tensor, threads).numpy(),
                                      together)
    for row in (0, 5, 10):
        alone = native_linear.linear(paddle.to_tensor(batch[row:row + 1]), tensor, 2).numpy()
        np.testing.assert_array_equal(alone[0], together[row])


def test_agrees_with_the_portable_op_and_takes_it_for_other_activation_dtypes():
    tensor, _ = weight(64, 96, seed=8)
    x = paddle.to_tensor(np.random.default_rng(9).standard_normal((7, 96)).astype(np.float32))
    np.testing.assert_allclose(native_linear.linear_or_portable(x, tensor, 2).numpy(),
                               portable.linear(x, tensor).numpy(), rtol=1e-5, atol=1e-5)
    wide = native_linear.linear_or_portable(x.astype("float64"), tensor, 2)
    assert wide.dtype == paddle.float64      # activations the kernel does not take: the portable op, their dtype


def test_mismatched_inputs_are_refused_before_the_c_call():
    tensor, _ = weight(8, 32, seed=1)
    with pytest.raises(ValueError, match="do not match"):
        native_linear.linear(paddle.zeros([2, 31]), tensor, 2)
    with pytest.raises(TypeError, match="float32 or bfloat16 weights"):
        native_linear.linear(paddle.zeros([2, 32]), paddle.zeros([8, 32], dtype="float64"), 2)
    with pytest.raises(TypeError, match="float32"):
        native_linear.linear(paddle.zeros([2, 32], dtype="float64"), tensor, 2)
