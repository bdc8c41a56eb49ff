"""The cpu plugin's GGUF linear kernel in q8 math (``cpu_native_gguf_q8_linear``) against its definition.

The definition: ``q8_inputs(x) @ dequantize(W)^T``, ``x`` quantized to 8 bits per 4 values as
`fdplug.plugin_api.gguf_formats.q8_inputs` says (llama.cpp's q8 activations, a scale per 4 values), the weights decoded
to
the portable op's exact float32, the products summed in float64 here; the kernel sums each 32
products as integers (exact) and the scaled sums in float32, so the two agree to float32 rounding.
The blocks are tests/test_cpu_gguf_kernel.py's (random bytes with finite scales, and gguf's own
quantized blocks). The kernel is built wherever the AVX2 tiles are (x86-64-v3 and AVX-512: the
same bits); chosen at x86-64-v3, by name above (tests/test_cpu_isa.py runs this file again at the
AVX2 cap).
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fdplug.core.quant.gguf_blocks import dequantize
from fdplug.plugin_api.gguf_formats import q8_inputs
from fdplug.plugins.cpu import isa, kernels, native_gguf
from tests.test_cpu_gguf_kernel import TYPES, depths, row_cases, weights

if kernels.unavailable_reason() is not None:
    pytest.skip(f"the cpu kernels do not build here: {kernels.unavailable_reason()}", allow_module_level=True)
if not native_gguf.q8_math_available():
    pytest.skip("the q8 tiles need the AVX2 build (x86-64-v3 or above)", allow_module_level=True)
QUANTIZED = [t for t in TYPES if t not in ("F16", "BF16")]


def q8(x: np.ndarray, w: paddle.Tensor, qtype: str, k: int, threads: int = 2) -> np.ndarray:
    return native_gguf.gguf_linear(paddle.to_tensor(x), w, qtype, k, threads=threads, q8_math=True).numpy()


def decoded(w: paddle.Tensor, qtype: str, k: int) -> np.ndarray:
    return dequantize(w, qtype, k, "float32").numpy().reshape(-1, k).astype(np.float64)


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_kernel_is_q8_math_on_the_decoded_weights(qtype):
    for k, w, x in row_cases(qtype, 37, seed=32, rng=np.random.default_rng(31)):
        x[0, :32] = 0.0                      # an all-zero run: scale 0, no division by it
        want = q8_inputs(x) @ decoded(w, qtype, k).T
        np.testing.assert_allclose(q8(x, w, qtype, k), want, rtol=1e-5, atol=2e-6 * np.abs(want).max(),
                                   err_msg=f"{qtype} K={k} {len(x)} rows")


def test_the_quantized_inputs_are_llama_cpp_q8_in_runs_of_4():
    """Each run of 4: scale amax / 127, values rounded to the nearest even integer in [-127, 127]."""
    x = np.array([[127.0, -63.5, 0.5, 1.5, 2.5, 0.0, 0.0, 0.0] + [0.0] * 24, [0.0] * 32], dtype=np.float32)
    got = q8_inputs(x)
    np.testing.assert_array_equal(got[0, :4], [127.0, -64.0, 0.0, 2.0])        # d = 1: ties to even
    assert got[0, 4] == pytest.approx(2.5, rel=1e-7) and not got[0, 5:].any()   # a run of its own: 127 x 2.5/127
    assert not got[1].any()
    x = np.random.default_rng(33).standard_normal((4, 64)).astype(np.float32) * 1e3
    steps = q8_inputs(x).reshape(4, 16, 4) / (np.abs(x).reshape(4, 16, 4).max(-1, keepdims=True) / 127)
    np.testing.assert_allclose(steps, np.rint(steps), atol=1e-4)
    assert np.abs(steps).max() <= 127.0 + 1e-4


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_the_same_bits_whatever_the_batch_or_the_threads(qtype):
    """A row alone (the register route: its blocks decoded in registers) and in a batch of 301 (at
    AVX2, the panel route: decoded once into a panel every row tile reads) give the same bits."""
    k = depths(qtype)[-1]
    w = weights(qtype, 45, k, seed=34)[0]
    x = np.random.default_rng(35).standard_normal((301, k)).astype(np.float32)
    batch = q8(x, w, qtype, k)
    for r in (0, 3, 4, 150, 299, 300):   # row tiles of 8 (of 6: Q4_1, Q4_K) and tails (301 = 37 x 8 + 5 = 50 x 6 + 1)
        np.testing.assert_array_equal(q8(x[r:r + 1], w, qtype, k, threads=1)[0], batch[r], err_msg=f"row {r}")
    np.testing.assert_array_equal(q8(x[:7], w, qtype, k, threads=1), batch[:7])


def test_the_error_against_float32_math_is_the_inputs_rounding():
    """q8 math differs from float32 math (the rounding shows) by no more than the quantization step
    allows: half a step (amax / 254 of each run of 4) times the |weights| it multiplies, summed."""
    k, rng = 576, np.random.default_rng(36)
    w = weights("Q4_1", 64, k, seed=37)[1]           # gguf's own blocks
    x = rng.standard_normal((16, k)).astype(np.float32)
    exact = native_gguf.gguf_linear(paddle.to_tensor(x), w, "Q4_1", k, threads=2).numpy()
    got = q8(x, w, "Q4_1", k)
    step = np.repeat(np.abs(x).reshape(16, -1, 4).max(-1) / 254, 4, axis=1)     # [rows, k]
    bound = step @ np.abs(decoded(w, "Q4_1", k)).T
    error = np.abs(got.astype(np.float64) - exact)
    assert error.max() > 0
    assert np.all(error <= bound * 1.001 + 1e-5 * np.abs(exact).max())
    assert np.abs(got - exact).max() / np.abs(exact).max() < 2e-2


def test_half_precision_rows_keep_float32_math():
    """F16 and BF16 rows hold no integers to keep: their calls run the float32 tiles, bit for bit."""
    for qtype in ("F16", "BF16"):
        k = depths(qtype)[0]
        w = weights(qtype, 21, k, seed=38)[0]
        x = np.random.default_rng(39).standard_normal((5, k)).astype(np.float32)
        np.testing.assert_array_equal(q8(x, w, qtype, k),
                                      native_gguf.gguf_linear(paddle.to_tensor(x), w, qtype, k, threads=2).numpy())


def test_chosen_at_x86_64_v3_after_the_packed_tiles_and_by_name_above(monkeypatch):
    """Second where the kernels are built for x86-64-v3 (no bf16 math there; q8 math 1.4-1.6x the
    float32 tiles at one row), after the packed q8 math: first there when the packed tiles are
    missing; at AVX-512 the float32, bf16 or packed tiles stay first (faster from a few rows), and it
    runs where it is named."""
    from fdplug.core.plugin_loading.selection import select_components
    from fdplug.plugins.cpu import native_gguf_packed

    selection = select_components("cpu")
    decision = next(d for d in selection.decisions if d.name == "cpu_native_gguf_q8_linear")
    if isa.level() == 3 and native_gguf_packed.available():
        assert selection.ops["gguf_linear"].name == "cpu_native_gguf_packed_linear"
        assert not decision.chosen and "priority 15" in decision.reason
        monkeypatch.setattr(native_gguf_packed, "available", lambda: False)
        selection = select_components("cpu")
        decision = next(d for d in selection.decisions if d.name == "cpu_native_gguf_q8_linear")
    if isa.level() == 3:
        assert selection.ops["gguf_linear"].name == "cpu_native_gguf_q8_linear" and "priority (15)" in decision.reason
    else:
        assert selection.ops["gguf_linear"].name in ("cpu_native_gguf_linear", "cpu_native_gguf_bf16_linear",
                                                     "cpu_native_gguf_packed_linear")
        assert not decision.chosen and "priority 5" in decision.reason
    named = select_components("cpu", ops={"gguf_linear": "cpu_native_gguf_q8_linear"}).ops["gguf_linear"]
    assert named.q8_inputs and not named.bf16_inputs


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "F16"])
def test_the_conformance_kit_checks_it_in_its_math(qtype):
    """The kit's gguf_linear check (fdplug.testing.test_numerics) compares a kernel with
    ``q8_inputs`` on the quantized inputs; with this kernel named, it passes."""
    from fdplug.core.plugin_loading.selection import select_components
    from fdplug.testing.test_numerics import (
        test_gguf_linear_kernel_matches_the_portable_one as kit_check,
    )

    selection = select_components("cpu", ops={"gguf_linear": "cpu_native_gguf_q8_linear"})
    kit_check(selection, "cpu", qtype)
