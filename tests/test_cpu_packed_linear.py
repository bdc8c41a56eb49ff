"""The cpu linear kernels on weights packed at load (``native_linear.prepare``, csrc/linear_packed.c).

Against the definition in numpy (float64 sums of the exact products: bf16 weights decoded from
their bits, bf16 inputs rounded to nearest even from theirs), and the exactness the engine relies
on: an output's bits do not depend on the other rows, the thread count, the tile a row falls in or
the k blocking (depth above 1,024 with more than one row tile), and bf16 weights in float32 math
give the float32 kernel's bits on the widened values.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fdplug.errors import SelectionError
from fdplug.plugin_api.ops import PreparedWeight
from fdplug.plugins.cpu import isa, kernels, native_linear
from tests.test_cpu_linear_kernel import weight

if kernels.unavailable_reason() is not None:
    pytest.skip(f"the cpu kernels do not build here: {kernels.unavailable_reason()}", allow_module_level=True)

BF16_MATH = native_linear.bf16_math_available()


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bf16 (ties to even), as float64."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32).astype(np.float64)


def run(x: np.ndarray, prepared: PreparedWeight, threads: int = 2, bf16_math: bool = False) -> np.ndarray:
    return native_linear.linear(paddle.to_tensor(x), prepared, threads, bf16_math).numpy()


def check(x: np.ndarray, prepared: PreparedWeight, exact: np.ndarray, bf16_math: bool = False) -> np.ndarray:
    got = run(x, prepared, bf16_math=bf16_math)
    xs = bf16_round(x) if bf16_math else x.astype(np.float64)
    want = xs @ exact.T
    bound = 1e-6 * (np.abs(xs) @ np.abs(exact).T) * x.shape[-1] ** 0.5 + 1e-30
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))
    return got


def kinds() -> list[tuple[str, bool]]:
    return [("float32", False), ("bfloat16", False)] + ([("bfloat16", True)] if BF16_MATH else [])


@pytest.mark.parametrize("k", [2, 30, 512, 1026, 2050])
@pytest.mark.parametrize("n", [16, 48, 64, 80, 208])
def test_every_panel_width_row_tile_and_k_block(n, k):
    """Panels of 16-64 columns (the last one narrower), row tiles of 1-6 and their tails, depths
    below, at and across the 1,024-deep k blocks; rows alone give the batch's bits. (AMX: 27 rows
    are a pair of row tiles, the second partial; 300 two blocks of row tiles, the last a pair and a
    partial one.)"""
    rng = np.random.default_rng(n * 10_000 + k)
    for dtype, bf16_math in kinds():
        tensor, exact = weight(n, k, seed=n + k, dtype=dtype)
        prepared = native_linear.prepare(tensor)
        assert prepared is not None and prepared.layout == native_linear.layout() and prepared.shape == (n, k)
        for rows in (1, 4, 6, 7, 13, 27, 40, 300):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            got = check(x, prepared, exact, bf16_math)
            for i in {0, rows // 2, rows - 1}:      # alone, on one thread: one row tile, no k blocks
                alone = run(x[i:i + 1], prepared, threads=1, bf16_math=bf16_math)
                np.testing.assert_array_equal(alone[0], got[i], err_msg=f"{dtype} {bf16_math} row {i} of {rows}")


def test_bf16_weights_in_float32_math_give_the_float32_kernels_bits():
    """Widening is exact and each output is the same FMA chain: the same bits as the float32 weights."""
    rng = np.random.default_rng(3)
    tensor, exact = weight(96, 1100, seed=3)
    widened = native_linear.prepare(paddle.to_tensor(exact.astype(np.float32)))
    packed = native_linear.prepare(tensor)
    for rows in (1, 5, 33):
        x = rng.standard_normal((rows, 1100)).astype(np.float32)
        np.testing.assert_array_equal(run(x, packed), run(x, widened))


def test_thread_counts_and_row_blocks_do_not_change_a_bit():
    """Enough rows for several row blocks (the input kept in L2) and pieces over 1, 2 and 3 threads."""
    rng = np.random.default_rng(5)
    for dtype, bf16_math in kinds():
        tensor, _ = weight(320, 512, seed=5, dtype=dtype)
        prepared = native_linear.prepare(tensor)
        x = rng.standard_normal((500, 512)).astype(np.float32)
        one = run(x, prepared, threads=1, bf16_math=bf16_math)
        for threads in (2, 3):
            np.testing.assert_array_equal(run(x, prepared, threads=threads, bf16_math=bf16_math), one)


def test_pieces_cut_into_row_blocks_for_the_threads_keep_every_bit():
    """Where the panels do not share evenly over the threads (144 columns: 3 panels of the AVX-512
    tiles, 9 of the AVX2 ones), each panel's row tiles are cut into blocks, items of their own
    (csrc/linear_packed.c, lp_split): every row must be computed once, with the bits it has alone."""
    rng = np.random.default_rng(11)
    for dtype, bf16_math in kinds():
        tensor, exact = weight(144, 256, seed=11, dtype=dtype)
        prepared = native_linear.prepare(tensor)
        for rows in (7, 13, 16, 40, 64, 191):
            x = rng.standard_normal((rows, 256)).astype(np.float32)
            got = check(x, prepared, exact, bf16_math)
            for threads in (1, 3, 4):
                np.testing.assert_array_equal(run(x, prepared, threads, bf16_math), got, err_msg=f"{rows} {threads}")
            for i in (0, rows // 3, rows - 1):
                np.testing.assert_array_equal(run(x[i:i + 1], prepared, 1, bf16_math)[0], got[i])


def test_packing_round_trips_and_applies_only_where_its_layout_does():
    rng = np.random.default_rng(7)
    for dtype in ("float32", "bfloat16"):
        tensor = paddle.to_tensor(rng.standard_normal((208, 34)).astype(np.float32)).astype(dtype)
        prepared = native_linear.prepare(tensor)
        assert prepared.dtype == tensor.dtype and prepared.data.shape == [208 * 34]
        unpacked = native_linear.unpack(prepared)
        np.testing.assert_array_equal(unpacked.astype("float32").numpy(), tensor.astype("float32").numpy())
    assert native_linear.prepare(paddle.ones([70, 32])) is None                      # N not a multiple of 16
    assert native_linear.prepare(paddle.ones([32, 33]).astype("bfloat16")) is None   # bf16 pairs need an even K
    assert native_linear.prepare(paddle.ones([32, 33])) is not None                  # float32 takes any K
    assert native_linear.prepare(paddle.ones([32, 32], dtype="int32")) is None


def test_a_weight_in_another_layout_or_shape_is_refused():
    prepared = native_linear.prepare(paddle.ones([32, 16]))
    with pytest.raises(ValueError, match="x \\[..., 8\\]"):
        native_linear.linear(paddle.ones([2, 8]), prepared, 2)
    alien = PreparedWeight(prepared.data, prepared.shape, "another_chip_tiles")
    with pytest.raises(ValueError, match="another_chip_tiles"):
        native_linear.linear(paddle.ones([2, 16]), alien, 2)
    float16 = PreparedWeight(prepared.data.astype("float16"), prepared.shape, prepared.layout)
    with pytest.raises(ValueError, match="float32 or bf16 weights .* got paddle.float16"):
        native_linear.linear(paddle.ones([2, 16]), float16, 2)
    with pytest.raises(TypeError, match="compute in float32, got paddle.float64"):
        native_linear.linear(paddle.ones([2, 16], dtype="float64"), prepared, 2)


def test_dtypes_compare_by_identity_then_by_equality():
    """The wrappers' dtype checks (`kernels.is_dtype`): identity first, `==` where identity fails."""

    class EqualsEverything:
        def __eq__(self, other: object) -> bool:
            return True

    assert kernels.is_dtype(paddle.float32, paddle.float32)
    assert not kernels.is_dtype(paddle.bfloat16, paddle.float32)
    assert kernels.is_dtype(EqualsEverything(), paddle.float32)
    assert kernels.is_float32(paddle.ones([2])) and not kernels.is_float32(paddle.ones([2], dtype="float64"))
    assert kernels.paddle_parts().empty([3, 2], paddle.float32, paddle.CPUPlace()).shape == [3, 2]


def test_the_portable_fallback_unpacks():
    """Activations the kernel does not take (float64 here) go to the portable matmul on the [N, K] values."""
    rng = np.random.default_rng(9)
    w = rng.standard_normal((48, 20)).astype(np.float32)
    x = rng.standard_normal((3, 20))
    got = native_linear.linear_or_portable(paddle.to_tensor(x), native_linear.prepare(paddle.to_tensor(w)), 2)
    np.testing.assert_allclose(got.numpy(), x @ w.T.astype(np.float64), rtol=1e-6)


def test_the_engine_packs_its_linear_layers_once_and_keeps_one_copy(test_model_dir):
    """Through `fdplug.LLM` on the cpu device: every linear layer prepared, the parameter footprint
    the same as the checkpoint's, and prompts decoded alone give the batch's tokens."""
    from fdplug.core.frontend.llm import LLM
    from fdplug.core.model.layers.linear import Linear
    from fdplug.plugin_api.sampling_params import SamplingParams

    pinned = {"linear": "cpu_native_linear"}   # not timed against paddle's: every layer runs it
    if isa.level() < 3:   # the CPU (or FDPLUG_CPU_ISA) below x86-64-v3: the tiles' scalar fallback is not chosen
        with pytest.raises(SelectionError, match="has tiles for x86-64-v3"):
            LLM(str(test_model_dir), max_model_len=64, num_kv_blocks=64, op_kernels=pinned)
        return
    llm = LLM(str(test_model_dir), max_model_len=64, num_kv_blocks=64, max_num_seqs=8, op_kernels=pinned)
    linears = [layer for layer in llm.engine.runner.model.sublayers() if isinstance(layer, Linear)]
    assert linears and all(layer.prepared is not None and layer.prepared.layout == native_linear.layout()
                           for layer in linears)
    params = sum(int(np.prod(p.shape)) for p in llm.engine.runner.model.parameters())
    assert llm.engine.runner.model_bytes == 4 * params
    prompts = [{"prompt_token_ids": ids} for ids in ([5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17])]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batch = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy, use_tqdm=False)]
    alone = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batch == alone


def test_a_preparation_must_keep_dtype_count_and_shape():
    """`Linear.prepare` refuses what would break footprints or the kernel's reading, keeps None
    (weights stay [N, K]) and prepares once."""
    from fdplug.core.model.layers.linear import Linear

    layer = Linear(8, 16, False, "float32", kernel=lambda x, w: w)
    paddle.assign(paddle.ones([16, 8]), layer.weight)
    with pytest.raises(ValueError, match="must keep"):
        layer.prepare(lambda w: PreparedWeight(w.astype("bfloat16"), (16, 8), "x"))
    with pytest.raises(ValueError, match="must keep"):
        layer.prepare(lambda w: PreparedWeight(w[:8], (16, 8), "x"))
    layer.prepare(lambda w: None)
    assert layer.prepared is None and layer.kernel_weight is layer.weight
    layer.prepare(native_linear.prepare)
    assert layer.prepared.layout == native_linear.layout() and layer.kernel_weight is layer.prepared
    assert list(layer.weight.shape) == [128] and layer.prepared.data is layer.weight
    layer.prepare(lambda w: pytest.fail("prepared twice"))


def test_the_bias_a_prepared_weight_carries_is_added_in_the_store_with_the_same_bits():
    """``PreparedWeight.bias``: the kernel's output plus the bias is exactly the float32 add after it,
    for every kind, past the k blocks, and for FP8 weights; the portable fallback adds it too."""
    from fdplug.plugins.cpu import native_fp8
    from tests.test_cpu_fp8_kernel import quantized

    rng = np.random.default_rng(13)
    bias = paddle.to_tensor(rng.standard_normal(80).astype(np.float32))
    for dtype, bf16_math in kinds():
        tensor, _ = weight(80, 1100, seed=13, dtype=dtype)
        plain = native_linear.prepare(tensor)
        biased = PreparedWeight(plain.data, plain.shape, plain.layout, bias)
        for rows in (1, 9):
            x = paddle.to_tensor(rng.standard_normal((rows, 1100)).astype(np.float32))
            np.testing.assert_array_equal(run(x.numpy(), biased, bf16_math=bf16_math),
                                          (native_linear.linear(x, plain, 2, bf16_math) + bias).numpy())
    q, scales = quantized(80, 256, 128, seed=14)
    plain = native_fp8.prepare(q)
    biased = PreparedWeight(plain.data, plain.shape, plain.layout, bias)
    x = paddle.to_tensor(rng.standard_normal((7, 256)).astype(np.float32))
    np.testing.assert_array_equal(native_fp8.fp8_linear(x, biased, scales, 128, 2).numpy(),
                                  (native_fp8.fp8_linear(x, plain, scales, 128, 2) + bias).numpy())
    tensor, exact = weight(80, 1100, seed=13, dtype="float32")
    packed = native_linear.prepare(tensor)
    x64 = paddle.to_tensor(rng.standard_normal((2, 1100)))        # float64: the portable fallback
    fallback = native_linear.linear_or_portable(x64, PreparedWeight(packed.data, packed.shape, packed.layout, bias), 2)
    np.testing.assert_allclose(fallback.numpy(), x64.numpy() @ exact.T + bias.numpy(), rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="float32 bias of \\[80\\]"):
        run(rng.standard_normal((1, 1100)).astype(np.float32),
            PreparedWeight(packed.data, packed.shape, packed.layout, bias[:3]))


def test_bf16_math_runs_on_amx_tiles_where_the_build_and_the_cpu_have_them(monkeypatch):
    """The native build on an AMX CPU runs the packed bf16 math on AMX tiles (csrc/linear_amx.c: the
    tests above check its sums, tails and batch invariance); FDPLUG_CPU_AMX=0 builds without them."""
    amx = "AMX-BF16" in isa.extensions()
    assert bool(kernels.load().fdplug_linear_amx_bf16()) == (amx and BF16_MATH)
    monkeypatch.setenv("FDPLUG_CPU_AMX", "0")
    assert not any(name.startswith("AMX") for name in isa.extensions())
    if isa.is_x86() and isa.cap() is None:
        assert isa.march() == ["-march=native", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
