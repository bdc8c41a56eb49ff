"""The cpu plugin's GGUF linear kernel in bf16 math (``cpu_native_gguf_bf16_linear``) against its definition.

The definition, in numpy: ``bf16(x) @ bf16(dequantize(W))^T``, the weights decoded to the portable
op's exact float32 (`gguf_blocks.dequantize`) and both factors rounded to bf16 (nearest even), the
products (exact in float32) summed in float64 here; the kernel sums in float32, so the two agree to
float32 rounding of the sums. The blocks are tests/test_cpu_gguf_kernel.py's (random bytes with
finite scales, and gguf's own quantized blocks). Needs AVX512-BF16 in the CPU and the build (the
kernel is not selected elsewhere, which `test_selection_falls_back_with_the_reason` checks).
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fdplug.core.quant.gguf_blocks import dequantize
from fdplug.plugins.cpu import kernels, native_gguf
from tests.test_cpu_gguf_kernel import (
    TYPES,
    depths,
    row_cases,
    selected_native,
    weights,
)

if kernels.unavailable_reason() is not None:
    pytest.skip(f"the cpu kernels do not build here: {kernels.unavailable_reason()}", allow_module_level=True)
BF16 = native_gguf.bf16_math_available()
needs_bf16 = pytest.mark.skipif(not BF16, reason="this CPU (or C compiler) has no AVX512-BF16: "
                                                 "cpu_native_gguf_bf16_linear is not selected here")


def bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (to nearest even), as float32 (no NaN here)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & np.uint32(0xFFFF0000)).view(np.float32)


def definition(x: np.ndarray, w: paddle.Tensor, qtype: str, k: int) -> np.ndarray:
    decoded = dequantize(w, qtype, k, "float32").numpy().reshape(-1, k)
    return bf16(x).astype(np.float64) @ bf16(decoded).astype(np.float64).T


@needs_bf16
@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_is_bf16_math_on_the_decoded_weights(qtype):
    for k, w, x in row_cases(qtype, 37, seed=22, rng=np.random.default_rng(21)):
        got = native_gguf.gguf_linear(paddle.to_tensor(x), w, qtype, k, threads=2, bf16_math=True).numpy()
        want = definition(x, w, qtype, k)
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * scale, err_msg=f"{qtype} K={k} {len(x)} rows")


@needs_bf16
def test_it_differs_from_float32_math_by_the_rounding_only():
    """bf16 math is not float32 math (the rounding shows), and not further from it than bf16's
    half-ulp on each factor allows (~2^-8 of the sum of |products|)."""
    k, rng = 576, np.random.default_rng(23)
    w = weights("Q4_1", 64, k, seed=24)[1]       # gguf's own blocks
    x = paddle.to_tensor(rng.standard_normal((16, k)).astype(np.float32))
    exact = native_gguf.gguf_linear(x, w, "Q4_1", k, threads=2).numpy()
    rounded = native_gguf.gguf_linear(x, w, "Q4_1", k, threads=2, bf16_math=True).numpy()
    assert not np.array_equal(exact, rounded)
    bound = np.abs(x.numpy()) @ np.abs(dequantize(w, "Q4_1", k, "float32").numpy().reshape(-1, k)).T * 2.0 ** -8
    assert np.all(np.abs(exact - rounded) <= bound)


@needs_bf16
@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "Q8_0"])
def test_the_same_bits_whatever_the_batch_the_route_or_the_threads(qtype):
    """A row alone on one thread (the register route) gives its bits in a batch of 300 on two (the
    panel route, the weights rounded once a thread): a token's logits do not depend on its batch."""
    k = depths(qtype)[1]
    w = weights(qtype, 37, k, seed=25)[0]
    x = paddle.to_tensor(np.random.default_rng(26).standard_normal((300, k)).astype(np.float32))
    batch = native_gguf.gguf_linear(x, w, qtype, k, threads=2, bf16_math=True).numpy()
    for r in (0, 7, 8, 299):
        alone = native_gguf.gguf_linear(x[r:r + 1], w, qtype, k, threads=1, bf16_math=True).numpy()
        np.testing.assert_array_equal(alone[0], batch[r], err_msg=f"row {r}")
    np.testing.assert_array_equal(native_gguf.gguf_linear(x[:9], w, qtype, k, threads=1, bf16_math=True).numpy(),
                                  batch[:9])


@needs_bf16
def test_an_odd_number_of_pieces_and_the_op_wrapper():
    """Depths of an odd number of 32-weight pieces (the last one in the first chain) and the op's
    reshaping of ``[..., K]`` inputs."""
    rng = np.random.default_rng(27)
    for k in (32, 96, 160):
        w = weights("Q8_0", 11, k, seed=k)[0]
        x = rng.standard_normal((2, 3, k)).astype(np.float32)
        got = native_gguf.gguf_linear_or_portable(paddle.to_tensor(x), w, "Q8_0", k, threads=2, bf16_math=True)
        assert got.shape == [2, 3, 11]
        want = definition(x.reshape(6, k), w, "Q8_0", k)
        np.testing.assert_allclose(got.numpy().reshape(6, 11), want, rtol=1e-5, atol=2e-6 * np.abs(want).max())


def test_selection_falls_back_with_the_reason(monkeypatch):
    """Chosen where the build has AVX512-BF16; elsewhere the next kernel (q8 math at x86-64-v3,
    float32 math at AVX-512), and explain says why."""
    from fdplug.core.plugin_loading.selection import select_components
    from fdplug.plugins.cpu import isa, native_gguf_packed

    if isa.level() < 3:
        pytest.skip("below x86-64-v3 the portable op is chosen (tests/test_cpu_gguf_kernel.py)")
    assert select_components("cpu").ops["gguf_linear"].name == selected_native()
    monkeypatch.setattr(native_gguf_packed, "available", lambda: False)   # (first where the CPU has VNNI)
    assert select_components("cpu").ops["gguf_linear"].name == selected_native()
    monkeypatch.setattr(native_gguf, "bf16_math_available", lambda: False)
    selection = select_components("cpu")
    assert selection.ops["gguf_linear"].name == selected_native()
    rejected = [d for d in selection.decisions if d.name == "cpu_native_gguf_bf16_linear"]
    assert len(rejected) == 1 and not rejected[0].chosen and "no AVX512-BF16" in rejected[0].reason
