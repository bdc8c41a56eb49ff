"""The cpu plugin's bf16-math linear kernel (``cpu_native_bf16_linear``) against the definition, in numpy.

With bf16 weights it rounds the activations to bf16 (to nearest, ties to even: written here from
the bits, not taken from paddle) and sums the bf16 x bf16 products, each exact in float32, in
float32; the reference sums the same products in float64, so the two agree to float32 rounding of a
sum of ``K`` products. Float32 weights must give ``cpu_native_linear``'s bits.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fdplug.plugins.cpu import kernels, native_linear
from tests.test_cpu_linear_kernel import weight

if kernels.unavailable_reason() is not None:
    pytest.skip(f"the cpu kernels do not build here: {kernels.unavailable_reason()}", allow_module_level=True)
if not native_linear.bf16_math_available():
    pytest.skip("this CPU (or C compiler) has no AVX512-BF16: cpu_native_bf16_linear is not selected here",
                allow_module_level=True)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bf16 (ties to even), as float64; NaN stays NaN."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return np.where(np.isnan(x), np.nan, rounded.view(np.float32)).astype(np.float64)


def run(x: np.ndarray, tensor: paddle.Tensor, threads: int = 2) -> np.ndarray:
    return native_linear.linear(paddle.to_tensor(x), tensor, threads, bf16_math=True).numpy()


def check(x: np.ndarray, tensor: paddle.Tensor, exact: np.ndarray) -> None:
    got, xr = run(x, tensor), bf16_round(x)
    want = xr @ exact.T
    bound = 1e-6 * (np.abs(xr) @ np.abs(exact).T) * x.shape[-1] ** 0.5 + 1e-30
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


@pytest.mark.parametrize("k", [1, 15, 31, 32, 33, 100, 512, 1000])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 70])
def test_every_tail_of_rows_columns_and_depth(n, k):
    """k tails of the 32-wide bf16 pairs (zero-padded inputs, masked weights), column and row tails
    of the 4x4 tiles, pieces of columns over threads."""
    tensor, exact = weight(n, k, seed=n * 1000 + k)
    rng = np.random.default_rng(k)
    for rows in (1, 2, 3, 4, 5, 9):
        check(rng.standard_normal((rows, k)).astype(np.float32), tensor, exact)


def test_the_inputs_are_rounded_to_bf16_not_truncated():
    """Inputs one bf16 step apart at the rounding boundary: ties go to even, above a tie up."""
    tensor = paddle.ones([1, 4]).astype("bfloat16")
    one_ulp = 2.0 ** -7                                            # a bf16 ulp at 1.0
    x = np.array([[1 + one_ulp / 2, 1 + 1.5 * one_ulp, 1 + one_ulp * 0.5001, 1 + one_ulp * 0.4999]], np.float32)
    assert run(x, tensor)[0, 0] == np.float32(1 + (1 + 2 * one_ulp) + (1 + one_ulp) + 1)


def test_a_row_is_the_same_bits_whatever_the_batch_and_the_threads():
    tensor, _ = weight(300, 520, seed=5)
    batch = np.random.default_rng(6).standard_normal((11, 520)).astype(np.float32)
    together = run(batch, tensor)
    for threads in (1, 3):
        np.testing.assert_array_equal(run(batch, tensor, threads), together)
    for row in (0, 5, 10):
        np.testing.assert_array_equal(run(batch[row:row + 1], tensor)[0], together[row])


def test_float32_weights_compute_as_cpu_native_linear():
    tensor, _ = weight(40, 130, seed=2, dtype="float32")
    x = np.random.default_rng(3).standard_normal((6, 130)).astype(np.float32)
    np.testing.assert_array_equal(run(x, tensor), native_linear.linear(paddle.to_tensor(x), tensor, 2).numpy())


def test_selected_on_this_cpu_and_explain_says_bf16_math(tmp_path):
    from click.testing import CliRunner

    from fdplug.cli import main
    from tests.conftest import write_test_model
    from tests.test_bf16_weights import rewrite

    bf16 = rewrite(write_test_model(tmp_path / "float"), tmp_path / "bf16", "bfloat16")
    out = CliRunner().invoke(main, ["explain", "--model", str(bf16)])
    assert out.exit_code == 0, out.output
    assert "inputs rounded to bf16 and float32 sums: cpu_native_bf16_linear" in out.output
    out = CliRunner().invoke(main, ["explain", "--model", str(bf16), "--op-kernel", "linear=cpu_native_linear"])
    assert out.exit_code == 0 and "(linear layers and lm_head: cpu_native_linear;" in out.output, out.output
