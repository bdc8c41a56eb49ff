"""The cpu plugin's FP8 linear kernel (``cpu_native_fp8_linear``) against the definition, in numpy.

The reference decodes e4m3 from its bit fields (sign, 4 exponent bits with bias 7, 3 mantissa
bits; exponent 0 is subnormal), written here rather than borrowed from paddle, multiplies by each
row's block scale and accumulates in float64.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fdplug.core.frontend.llm import LLM
from fdplug.errors import SelectionError
from fdplug.plugin_api.fp8 import block_quant
from fdplug.plugins.cpu import isa, kernels, native_fp8

if kernels.unavailable_reason() is not None:
    pytest.skip(f"the cpu kernels do not build here: {kernels.unavailable_reason()}", allow_module_level=True)


def e4m3_values() -> np.ndarray:
    """The float value of each of the 256 e4m3fn codes (NaN for 0x7F and 0xFF)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return np.where((codes & 0x7F) == 0x7F, np.nan, sign * magnitude)


def reference(x: np.ndarray, q, scales, block_k: int) -> np.ndarray:
    w = e4m3_values()[q.view(paddle.uint8).numpy()]
    w = w * np.repeat(scales.numpy().astype(np.float64), block_k, axis=1)[:, :w.shape[1]]
    return x.astype(np.float64) @ w.T


def quantized(n: int, k: int, block_k: int, seed: int):
    """An FP8 weight whose values span e4m3's range (subnormals and 448 included), per-row scales."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)) * np.exp(rng.uniform(-9, 3, (n, k)))
    w[0, : min(k, 5)] = 0.0
    q, grid = block_quant(paddle.to_tensor(w.astype(np.float32)), (block_k, block_k))
    return q, paddle.repeat_interleave(grid, block_k, axis=0)[:n]


@pytest.mark.parametrize("n, k, block_k", [(1, 1, 128), (5, 7, 32), (33, 130, 128), (64, 136, 32), (40, 512, 128)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
def test_kernel_matches_the_definition(n, k, block_k, rows):
    """K not a multiple of 16, 8 or the block (every tail path), 1 to 20 rows (partial 8-row tiles)."""
    q, scales = quantized(n, k, block_k, seed=n * 31 + k)
    codes = q.view(paddle.uint8).numpy()
    if n * k >= 1000:   # the larger cases hold subnormals and the largest code, 448
        assert ((codes & 0x78) == 0).any() and (np.abs(e4m3_values()[codes]) == 448).any()
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    got = native_fp8.fp8_linear(paddle.to_tensor(x), q, scales, block_k, threads=2).numpy()
    want = reference(x, q, scales, block_k)
    bound = 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(e4m3_values()[codes] * 1.0).T * scales.numpy().max()).max()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=bound)


def test_the_same_bits_whatever_the_thread_count():
    q, scales = quantized(3000, 256, 128, seed=3)
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((6, 256)).astype(np.float32))
    one = native_fp8.fp8_linear(x, q, scales, 128, threads=1).numpy()
    assert np.array_equal(one, native_fp8.fp8_linear(x, q, scales, 128, threads=2).numpy())
    assert np.array_equal(one[2], native_fp8.fp8_linear(x[2:3], q, scales, 128, threads=2).numpy()[0])  # batch-free


def test_long_inputs_widen_the_layer_once_and_shapes_are_checked():
    q, scales = quantized(16, 72, 32, seed=4)     # 72: an edge block of 8
    np.testing.assert_array_equal(native_fp8.dequantize(q, scales, 32, threads=2).numpy(),
                                  reference(np.eye(72, dtype=np.float32), q, scales, 32).T.astype(np.float32))
    x = paddle.to_tensor(np.random.default_rng(1).standard_normal((native_fp8.FP8_MAX_ROWS + 1, 72)).astype("float32"))
    np.testing.assert_allclose(native_fp8.fp8_linear_or_portable(x, q, scales, 32, threads=2).numpy(),
                               reference(x.numpy(), q, scales, 32), rtol=1e-5, atol=1e-5)
    assert native_fp8.fp8_linear(x[:0], q, scales, 32, threads=2).shape == [0, 16]
    with pytest.raises(ValueError, match="do not match block_k=64"):
        native_fp8.fp8_linear(x, q, scales, 64, threads=2)
    with pytest.raises(ValueError, match="do not match block_k=64"):
        native_fp8.dequantize(q, scales, 64, threads=2)


@pytest.mark.parametrize("n, k, block_k", [(80, 72, 32), (48, 1100, 128), (16, 2, 1), (320, 512, 128)])
def test_packed_weights_widen_in_registers_with_the_same_bits_for_any_rows(n, k, block_k):
    """Weights packed at load (one byte each still): against the float64 definition; the same bits
    as the layer dequantized and run through the packed float32 tiles (a weight is e4m3 x scale
    rounded once either way); a row alone on one thread gives the batch's bits; and the prepared
    weight round-trips through the portable fallback."""
    from fdplug.plugins.cpu import native_linear

    q, scales = quantized(n, k, block_k, seed=n + k)
    packed = native_fp8.prepare(q)
    assert packed.layout == native_linear.layout() and packed.dtype == q.dtype and packed.shape == (n, k)
    rng = np.random.default_rng(n)
    for rows in (1, 5, 7, 300):
        x = paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32))
        got = native_fp8.fp8_linear_or_portable(x, packed, scales, block_k, threads=2).numpy()
        want = reference(x.numpy(), q, scales, block_k)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        widened = native_linear.prepare(native_fp8.dequantize(q, scales, block_k, threads=2))
        np.testing.assert_array_equal(got, native_linear.linear(x, widened, 2).numpy())
        alone = native_fp8.fp8_linear(x[rows - 1:rows], packed, scales, block_k, threads=1).numpy()
        np.testing.assert_array_equal(alone[0], got[rows - 1])
    x64 = rng.standard_normal((2, k))                 # float64 x: the portable op, on the unpacked weight
    portable = native_fp8.fp8_linear_or_portable(paddle.to_tensor(x64), packed, scales, block_k, threads=2)
    want = reference(x64, q, scales, block_k)
    np.testing.assert_allclose(portable.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert native_fp8.prepare(quantized(20, 72, 32, seed=1)[0]) is None       # 20 columns: not in panels


def test_an_fp8_model_decodes_the_same_tokens_with_the_kernel(tmp_path):
    """The demo model in FP8 (online, 128x128 blocks): the kernel and the portable op give the same
    greedy tokens (float32 rounding apart, the same numbers)."""
    params = __import__("fdplug").SamplingParams(temperature=0, max_tokens=24, logprobs=1)
    prompts = [[{"role": "user", "content": "Hello"}], [{"role": "user", "content": "What does the for statement do?"}]]
    if isa.level() < 3:   # the CPU (or FDPLUG_CPU_ISA) below x86-64-v3: the tiles' scalar fallback is not chosen
        with pytest.raises(SelectionError, match="has tiles for x86-64-v3"):
            LLM(quantization="fp8", op_kernels={"fp8_linear": "cpu_native_fp8_linear"}, max_model_len=256)
        return
    runs = {}
    for kernel in ("cpu_native_fp8_linear", "paddle_fp8_linear"):
        llm = LLM(quantization="fp8", op_kernels={"fp8_linear": kernel}, max_model_len=256, num_kv_blocks=64)
        assert llm.engine.selection.ops["fp8_linear"].name == kernel
        runs[kernel] = [o.outputs[0] for o in llm.chat(prompts, params, use_tqdm=False)]
    native, plain = runs.values()
    assert [o.token_ids for o in native] == [o.token_ids for o in plain]
    for a, b in zip(native, plain):
        for step_a, step_b, token in zip(a.logprobs, b.logprobs, a.token_ids):
            assert abs(step_a[token].logprob - step_b[token].logprob) < 1e-3


@pytest.mark.parametrize("tokens", [0, 1, 7, 40])
def test_fp8_experts_match_the_reference_backend(tokens):
    """cpu_native on fp8_block experts (two compiled FP8 linears an expert, weights never widened in
    memory) against the reference backend (each expert dequantized, then paddle matmuls)."""
    from fdplug.core.portable.moe import ReferenceMoE
    from fdplug.plugins.cpu.native_moe import Fp8Experts, NativeCpuMoE
    from tests.test_blackwell_moe import fp8_experts, routed

    weights = fp8_experts(seed=5, block=(32, 128))
    native, ref = NativeCpuMoE(threads=2), ReferenceMoE()
    layer = native.load_weights(weights)
    assert isinstance(layer, Fp8Experts) and layer.w13.dtype == paddle.float8_e4m3fn
    hidden, topk_weights, topk_ids = routed(tokens, seed=tokens)
    got = native.forward(hidden, topk_weights, topk_ids, layer).numpy()
    want = ref.forward(hidden, topk_weights, topk_ids, ref.load_weights(weights)).numpy()
    assert got.shape == (tokens, hidden.shape[1])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * (np.abs(want).max() if tokens else 1))


def test_a_tokens_experts_output_does_not_depend_on_the_batch_or_the_threads():
    """The fused FP8 MoE call: each token's row bit for bit the same alone on one thread as among
    39 others on two (its experts' rows land elsewhere in the grouped GEMMs, its sum runs in k order)."""
    from fdplug.plugins.cpu.native_moe import NativeCpuMoE
    from tests.test_blackwell_moe import fp8_experts, routed

    layer = NativeCpuMoE(threads=2).load_weights(fp8_experts(seed=6, block=(128, 128)))
    hidden, topk_weights, topk_ids = routed(40, seed=8)
    ids, weights = topk_ids.numpy(), topk_weights.numpy()
    batch = native_fp8.fp8_moe(hidden, layer, ids, weights, threads=2).numpy()
    for t in (0, 17, 39):
        alone = native_fp8.fp8_moe(hidden[t:t + 1], layer, ids[t:t + 1], weights[t:t + 1], threads=1).numpy()
        assert np.array_equal(alone[0], batch[t])


def test_fp8_experts_refuse_an_expert_id_out_of_range():
    from fdplug.plugins.cpu.native_moe import NativeCpuMoE
    from tests.test_blackwell_moe import E, fp8_experts, routed

    native = NativeCpuMoE(threads=2)
    hidden, topk_weights, topk_ids = routed(3)
    with pytest.raises(ValueError, match=f"expert id {E} is outside"):
        native.forward(hidden, topk_weights, topk_ids * 0 + E, native.load_weights(fp8_experts()))
