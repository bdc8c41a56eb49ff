"""Attention and MoE backends and op kernels of the device under test against the CPU reference."""

from __future__ import annotations

import numpy as np
import pytest

from fdplug.core.config import EngineConfig
from fdplug.plugin_api.gguf_formats import q8_inputs
from fdplug.testing.cases import attention_cases, moe_cases, run_attention, run_moe


def _reference(role: str):
    from fdplug.core.portable.attention import ReferenceAttention
    from fdplug.core.portable.moe import ReferenceMoE

    return ReferenceAttention() if role == "attention" else ReferenceMoE()


@pytest.mark.parametrize("case", attention_cases(seed=7), ids=lambda c: c.describe())
def test_attention_matches_cpu_reference(case, attention_backend_name, fdplug_plugin_set, fdplug_place,
                                         fdplug_atol, fdplug_selection):
    if attention_backend_name is None:
        pytest.fail("no attention backend runs on this device")
    spec = fdplug_plugin_set.registry.get("attention", attention_backend_name).spec
    backend = spec.factory(EngineConfig())
    got = run_attention(backend, case, place=fdplug_place)
    expected = run_attention(_reference("attention"), case, place="cpu")
    for step, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, atol=fdplug_atol, rtol=fdplug_atol, err_msg=f"step {step}")


@pytest.mark.parametrize("case", moe_cases(seed=3), ids=lambda c: c.label)
def test_moe_matches_cpu_reference(case, moe_backend_name, fdplug_plugin_set, fdplug_place, fdplug_atol,
                                   fdplug_selection):
    if moe_backend_name is None:
        pytest.fail("no MoE backend runs on this device")
    spec = fdplug_plugin_set.registry.get("moe", moe_backend_name).spec
    if "none" not in spec.weight_formats:
        pytest.skip(f"{moe_backend_name} runs only {spec.weight_formats}; its format has its own tests")
    got = run_moe(spec.factory(EngineConfig()), case, place=fdplug_place)
    expected = run_moe(_reference("moe"), case, place="cpu")
    np.testing.assert_allclose(got, expected, atol=fdplug_atol, rtol=fdplug_atol)


def test_moe_gguf_experts_match_cpu_reference(moe_backend_name, fdplug_plugin_set, fdplug_place, fdplug_selection):
    """A MoE backend that lists the ``gguf`` expert format, on a GGUF file's experts (random GGML
    blocks, `ExpertWeights.qtypes` per projection: a Q4_K_M file's Q4_K gate/up and Q6_K down, and
    Q8_0/Q4_1/Q5_0), 1 to 33 tokens, against the reference backend's dequantize-and-matmul."""
    import paddle

    from fdplug.plugin_api.moe import ExpertWeights

    spec = fdplug_plugin_set.registry.get("moe", moe_backend_name).spec if moe_backend_name else None
    if spec is None or "gguf" not in spec.weight_formats:
        pytest.skip(f"{moe_backend_name} does not list the gguf expert format")
    rng = np.random.default_rng(13)
    e, h, i = 6, 256, 512
    for qtypes in ({"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, {"gate": "Q8_0", "up": "Q4_1", "down": "Q5_0"}):
        blocks = {name: _random_gguf_blocks(qtypes[name], e * rows, cols, rng).reshape(e, rows, -1)
                  for name, rows, cols in (("gate", i, h), ("up", i, h), ("down", h, i))}
        runs = []
        for backend, place in ((spec.factory(EngineConfig()), fdplug_place), (_reference("moe"), "cpu")):
            paddle.set_device(place)
            layer = backend.load_weights(ExpertWeights(*(paddle.to_tensor(blocks[n]) for n in ("gate", "up", "down")),
                                                       format="gguf", qtypes=dict(qtypes)))
            runs.append((backend, layer))
        for tokens in (1, 5, 33):
            x = rng.standard_normal((tokens, h)).astype(np.float32)
            ids = np.stack([rng.choice(e, 2, replace=False) for _ in range(tokens)]).astype(np.int64)
            weights = rng.uniform(0.1, 1.0, (tokens, 2)).astype(np.float32)
            outs = []
            for (backend, layer), place in zip(runs, (fdplug_place, "cpu")):
                paddle.set_device(place)
                args = (paddle.to_tensor(a) for a in (x, weights, ids))
                outs.append(backend.forward(*args, layer).astype("float32").numpy())
            np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5 * np.abs(outs[1]).max(),
                                       err_msg=f"{qtypes}, {tokens} tokens")
    paddle.set_device(fdplug_place)


@pytest.mark.parametrize("op", ["swiglu", "rms_norm"])
def test_op_kernels_match_the_portable_ones(op, fdplug_selection, fdplug_place):
    """The op kernel selected for the device (`fdplug.plugin_api.ops`) against the core's portable one."""
    import paddle

    from fdplug.core.portable import ops as portable

    kernel = fdplug_selection.ops[op].factory(EngineConfig())
    rng = np.random.default_rng(5)
    paddle.set_device(fdplug_place)
    for rows in (1, 7, 300):
        x = paddle.to_tensor(rng.standard_normal((rows, 2 * 96), dtype=np.float32))
        if op == "swiglu":
            got, expected = kernel(x), portable.swiglu(x)
        else:
            weight = paddle.to_tensor(rng.standard_normal(2 * 96, dtype=np.float32))
            got, expected = kernel(x, weight, 1e-6), portable.rms_norm(x, weight, 1e-6)
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{rows} rows")
    if op == "rms_norm":     # Qwen3's q/k norm: [tokens, heads, dim] rows, one weight row per head
        x = paddle.to_tensor(rng.standard_normal((5, 6, 40), dtype=np.float32))
        weight = paddle.to_tensor(rng.standard_normal((6, 40), dtype=np.float32))
        np.testing.assert_allclose(kernel(x, weight, 1e-6).numpy(), portable.rms_norm(x, weight, 1e-6).numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg="per-head weights")


def test_add_rms_norm_and_rope_kernels_match_the_portable_ones(fdplug_selection, fdplug_place):
    """``add_rms_norm``: the sum exactly ``x + residual``, the norm to float32 rounding; ``rope``: 1 to
    300 tokens of ``[T, heads, D]`` with the tables as ``RotaryEmbedding.lookup`` gives them (a
    kernel may match the portable op's bits: this kit asks float32 rounding)."""
    import paddle

    from fdplug.core.model.checkpoint.rope import RopeConfig
    from fdplug.core.model.layers.basic import RotaryEmbedding
    from fdplug.core.portable import ops as portable

    add_norm = fdplug_selection.ops["add_rms_norm"].factory(EngineConfig())
    rope = fdplug_selection.ops["rope"].factory(EngineConfig())
    rng = np.random.default_rng(6)
    paddle.set_device(fdplug_place)
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), 64, 4096, "float32", heads=6)
    for rows in (1, 7, 300):
        x, residual = (paddle.to_tensor(rng.standard_normal((rows, 136), dtype=np.float32)) for _ in range(2))
        weight = paddle.to_tensor(rng.standard_normal(136, dtype=np.float32))
        inputs = x.numpy().copy(), residual.numpy().copy()
        got, total = add_norm(x, residual, weight, 1e-6)
        expected, expected_total = portable.add_rms_norm(x, residual, weight, 1e-6)
        np.testing.assert_array_equal(total.numpy(), expected_total.numpy())
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{rows} rows")
        np.testing.assert_array_equal(x.numpy(), inputs[0])
        np.testing.assert_array_equal(residual.numpy(), inputs[1])
        heads = paddle.to_tensor(rng.standard_normal((rows, 6, 64), dtype=np.float32))
        before = heads.numpy().copy()
        cos, sin = rotary.lookup(paddle.to_tensor(rng.integers(0, 4096, rows)))
        np.testing.assert_allclose(rope(heads, cos, sin).numpy(), portable.rope(heads, cos, sin).numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=f"rope, {rows} tokens")
        np.testing.assert_array_equal(heads.numpy(), before)


def test_argmax_kernel_matches_the_portable_one(fdplug_selection, fdplug_place):
    """The selected ``argmax`` exactly as the portable one: ties (the lowest index), NaN (never
    chosen), -inf rows, widths that are not a multiple of any vector width, 1 to 300 rows."""
    import paddle

    from fdplug.core.portable import ops as portable

    kernel = fdplug_selection.ops["argmax"].factory(EngineConfig())
    rng = np.random.default_rng(8)
    paddle.set_device(fdplug_place)
    for rows, cols in ((1, 5), (3, 37), (64, 32000), (300, 129)):
        x = rng.integers(-3, 4, (rows, cols)).astype(np.float32)   # many ties
        x[0, cols // 2] = np.nan
        x[-1, :] = -np.inf
        if rows > 2:
            x[1, :] = np.nan
            x[1, -1] = 0.0
        got = np.asarray(kernel(paddle.to_tensor(x)))
        np.testing.assert_array_equal(got, portable.argmax(paddle.to_tensor(x)), err_msg=f"{rows}x{cols}")
        assert got.dtype == np.int64 and got.shape == (rows,)


def test_fp8_linear_kernel_matches_the_portable_one(fdplug_selection, fdplug_place):
    """The selected ``fp8_linear`` kernel against the portable dequantize-and-matmul: K that is not a
    multiple of the block (edge blocks), 32- and 128-wide blocks, 1 to 300 rows, e4m3 weights across
    their range (subnormals, both signs); with ``prepare``, on the prepared weights too."""
    import paddle

    from fdplug.core.portable import ops as portable
    from fdplug.plugin_api.fp8 import block_quant

    spec = fdplug_selection.ops["fp8_linear"]
    kernel = spec.factory(EngineConfig())
    prepare = spec.prepare(EngineConfig()) if spec.prepare is not None else None
    rng = np.random.default_rng(9)
    paddle.set_device(fdplug_place)
    for (n, k), bk in (((70, 200), 128), ((96, 136), 32), ((256, 512), 128), ((80, 1100), 128)):
        w = rng.standard_normal((n, k)).astype(np.float32) * np.exp(rng.uniform(-8, 3, (n, k))).astype(np.float32)
        q, grid = block_quant(paddle.to_tensor(w), (bk, bk))
        scales = paddle.repeat_interleave(grid, bk, axis=0)[:n]
        weights = [(q, 0.0)]
        prepared = prepare(q) if prepare is not None else None
        if prepared is not None:
            from fdplug.plugin_api.ops import PreparedWeight

            assert tuple(prepared.shape) == (n, k) and prepared.dtype == q.dtype
            bias = rng.standard_normal(n).astype(np.float32)
            weights += [(prepared, 0.0),
                        (PreparedWeight(prepared.data, prepared.shape, prepared.layout, paddle.to_tensor(bias)), bias)]
        for rows in (1, 3, 8, 9, 300):
            x = paddle.to_tensor(rng.standard_normal((rows, k), dtype=np.float32))
            expected = portable.fp8_linear(x, q, scales, bk).numpy()
            scale = np.abs(expected).max()
            for each, added in weights:
                got = kernel(x, each, scales, bk).numpy()
                np.testing.assert_allclose(got, expected + added, rtol=1e-5, atol=1e-5 * scale,
                                           err_msg=f"{n}x{k}/{bk} {rows} rows, {type(each).__name__}")


def _random_gguf_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``[n, row_bytes]`` random GGML blocks of ``qtype`` (every bit pattern of the packed integers)
    whose float16 scales (d, and m / dmin where the type has one) are finite, of either sign."""
    from fdplug.plugin_api.gguf_formats import BLOCK_FORMATS

    fmt = BLOCK_FORMATS[qtype]
    if qtype in ("F16", "BF16"):   # values of either sign below 1 in magnitude, as bits of the type
        values = rng.uniform(-1.0, 1.0, (n, k)).astype(np.float32)
        return (values.astype(np.float16).view(np.uint8) if qtype == "F16"
                else (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)).reshape(n, -1)
    raw = rng.integers(0, 256, (n, k // fmt.block, fmt.nbytes), dtype=np.uint8)
    at, count = (208, 1) if qtype == "Q6_K" else (0, 2 if qtype in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 1)
    shape = (n, k // fmt.block, count)
    scales = rng.choice([-1.0, 1.0], shape) * np.exp(rng.uniform(np.log(1e-4), np.log(1e-1), shape))
    raw[..., at:at + 2 * count] = scales.astype(np.float16).view(np.uint8).reshape(n, k // fmt.block, 2 * count)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"])
def test_gguf_linear_kernel_matches_the_portable_one(fdplug_selection, fdplug_place, qtype):
    """The selected ``gguf_linear`` kernel against the portable dequantize-and-matmul, on random blocks
    of each GGML type (every packed bit pattern, scales of both signs): N = 70 (no multiple of a
    tile), depths of 1, 6 and 18 blocks (32-weight types: 32, 192, 576; K-quants: 256 to 4608), 1 to 300
    rows; with ``prepare``, on the prepared weight too (same bytes, same element count). A kernel
    with ``bf16_inputs`` against the same product on ``bf16(x)`` and each decoded weight's bf16; one
    with ``q8_inputs`` against the portable op on ``x`` quantized as `gguf_formats.q8_inputs` says (in
    runs of the spec's `OpSpec.q8_run`)."""
    import paddle

    from fdplug.core.portable import ops as portable

    spec = fdplug_selection.ops["gguf_linear"]
    kernel = spec.factory(EngineConfig())
    rounded = (lambda t: t.astype("bfloat16").astype("float32")) if spec.bf16_inputs else (lambda t: t)
    prepare = spec.prepare(EngineConfig()) if spec.prepare is not None else None
    rng = np.random.default_rng(11)
    paddle.set_device(fdplug_place)
    block = 256 if qtype.endswith("_K") else 32
    for k in (block, 6 * block, 18 * block):
        weight = paddle.to_tensor(_random_gguf_blocks(qtype, 70, k, rng))
        weights = [weight]
        prepared = prepare(weight, qtype) if prepare is not None else None
        if prepared is not None:
            assert prepared.data.dtype == weight.dtype and int(np.prod(prepared.data.shape)) == weight.size
            weights.append(prepared)
        for rows in (1, 3, 8, 9, 300):
            x = paddle.to_tensor(rng.standard_normal((rows, k), dtype=np.float32))
            if spec.bf16_inputs:   # bf16 math: the definition on the rounded values
                wanted = rounded(portable.gguf_linear(paddle.eye(k, dtype="float32"), weight, qtype, k))
                expected = (rounded(x) @ wanted).numpy()
            elif spec.q8_inputs and qtype not in ("F16", "BF16"):   # q8 math: on the quantized x
                decoded = portable.gguf_linear(paddle.eye(k, dtype="float32"), weight, qtype, k).numpy()
                expected = q8_inputs(x.numpy(), spec.q8_run) @ decoded.astype(np.float64)
            else:
                expected = portable.gguf_linear(x, weight, qtype, k).numpy()
            scale = np.abs(expected).max()
            for each in weights:
                got = kernel(x, each, qtype, k).numpy()
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * scale,
                                           err_msg=f"{qtype} 70x{k} {rows} rows, {type(each).__name__}")


@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16"])
def test_linear_kernel_matches_the_portable_one(fdplug_selection, fdplug_place, weight_dtype):
    """The selected ``linear`` kernel against the portable matmul: depths that are not a multiple of
    any vector width, 1 to 300 rows, weights spanning bf16's range, float32 and bf16 weights (a
    device computing in bf16 runs the float32 case in its dtype: this kit compares in float32). A
    kernel with ``bf16_inputs`` is compared on bf16 weights with the portable op on ``bf16(x)``; one
    with ``prepare`` on the weights it prepared too (where it prepares them), with the shape and
    dtype `Linear.prepare` requires."""
    import paddle

    from fdplug.core.portable import ops as portable

    spec = fdplug_selection.ops["linear"]
    kernel = spec.factory(EngineConfig())
    prepare = spec.prepare(EngineConfig()) if spec.prepare is not None else None
    rounds_x = spec.bf16_inputs and weight_dtype == "bfloat16"
    rng = np.random.default_rng(10)
    paddle.set_device(fdplug_place)
    for n, k in ((70, 200), (96, 17), (256, 512), (80, 1100)):
        w = rng.standard_normal((n, k)).astype(np.float32) * np.exp(rng.uniform(-8, 3, (n, k))).astype(np.float32)
        weight = paddle.to_tensor(w).astype(weight_dtype)
        weights = [(weight, 0.0)]
        prepared = prepare(weight) if prepare is not None else None
        if prepared is not None:
            from fdplug.plugin_api.ops import PreparedWeight

            assert tuple(prepared.shape) == (n, k) and prepared.dtype == weight.dtype
            assert int(np.prod(prepared.data.shape)) == n * k
            bias = rng.standard_normal(n).astype(np.float32)
            weights += [(prepared, 0.0),       # and carrying a bias, which the kernel adds
                        (PreparedWeight(prepared.data, prepared.shape, prepared.layout, paddle.to_tensor(bias)), bias)]
        for rows in (1, 3, 8, 9, 300):
            x = paddle.to_tensor(rng.standard_normal((rows, k), dtype=np.float32))
            expected = portable.linear(x.astype("bfloat16").astype("float32") if rounds_x else x, weight).numpy()
            scale = np.abs(expected).max()
            for each, added in weights:
                got = kernel(x, each).numpy()
                np.testing.assert_allclose(got, expected + added, rtol=1e-5, atol=1e-5 * scale,
                                           err_msg=f"{n}x{k} {rows} rows, {type(each).__name__}")
