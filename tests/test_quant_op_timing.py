"""Selection that measures, for the quantized linears (`fdplug.core.worker.op_timing`): an
``fp8_linear`` or ``gguf_linear`` kernel with an `OpSpec.measure_key`, chosen by priority, runs only
the layer shapes (a GGUF projection: per block-type group) where it is not slower than the portable
op; the others run the portable op on the weights as stored, and keep a fused decoder stack off.

The timer is replaced where a test needs a verdict; the real one runs in
`test_explain_shows_the_real_figures_of_a_gguf_model`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle
import pytest
from click.testing import CliRunner

from fdplug.cli import main
from fdplug.core.model.checkpoint.config import ModelConfig
from fdplug.core.model.layers.decoder import DecoderForCausalLM
from fdplug.core.model.layers.fp8_linear import Fp8Linear
from fdplug.core.model.layers.gguf_linear import GgufLinear
from fdplug.core.model.layers.linear_shapes import fp8_format, linear_shapes
from fdplug.core.portable.ops import PORTABLE
from fdplug.core.quant.gguf_blocks import dequantize, sample_blocks
from fdplug.core.worker import op_timing
from fdplug.plugin_api.gguf_formats import BLOCK_FORMATS, row_bytes
from fdplug.plugin_api.ops import PreparedWeight
from fdplug.plugins.cpu import isa, kernels
from fdplug.testing.gguf_kit import write_pair
from tests.conftest import kernel_wins
from tests.test_gguf_models import CASES

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
NEEDS_KERNELS = pytest.mark.skipif(kernels.unavailable_reason() is not None or isa.level() < 3,
                                   reason="the cpu linear kernels need their build and x86-64-v3 (FDPLUG_CPU_ISA)")


def _gguf_calls(model: DecoderForCausalLM) -> set[tuple]:
    """``(rows, K, type, prepared, logits)`` of every call the built decoder makes of ``gguf_linear``."""
    calls = {(rows, layer.in_features, qtype, True, layer is model.lm_head)
             for layer in model.sublayers() if isinstance(layer, GgufLinear) for qtype, rows in layer.layout.groups}
    if model.lm_head is None and model.embed_type is not None:
        calls.add((model.config.vocab_size, model.config.hidden_size, model.embed_type, True, True))
    return calls


@pytest.mark.parametrize("arch", sorted(CASES))
def test_the_gguf_shapes_from_the_config_are_the_decoders_calls(tmp_path, arch):
    """Every block type, fused projections mixing types, tied and untied lm_heads in blocks, a
    float embedding: what is timed before load is what the decoder calls."""
    tied, types = CASES[arch]
    gguf, _ = write_pair(tmp_path, arch, types=types, tied=tied)
    cfg = ModelConfig.from_dir(gguf).keep_weights("float32", None)
    model = DecoderForCausalLM(cfg, attn_backend=None)
    assert {s.key for s in linear_shapes(cfg, "float32", "gguf_linear")} == _gguf_calls(model)
    assert linear_shapes(cfg, "float32", "fp8_linear") == []


def test_the_fp8_shapes_from_the_config_are_the_decoders_layers():
    cfg = ModelConfig.from_dir(GOLDEN / "llama", quantization="fp8").keep_weights("float32", None)
    model = DecoderForCausalLM(cfg, attn_backend=None)
    built = {(*map(int, layer.weight.shape), fp8_format(layer.block_k), True, False)
             for layer in model.sublayers() if isinstance(layer, Fp8Linear)}
    shapes = linear_shapes(cfg, "float32", "fp8_linear")
    assert built and {s.key for s in shapes} == built
    assert {name for s in shapes for name in s.layers} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert linear_shapes(cfg, "float32", "gguf_linear") == []


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
def test_sampled_blocks_decode_to_finite_values(qtype):
    """The timing's random weights: the layout of the type, and no NaN or infinity in them."""
    rng = np.random.default_rng(7)
    k = 512
    raw = sample_blocks(qtype, 6, k, rng)
    assert raw.dtype == np.uint8 and raw.shape == (6, row_bytes(qtype, k))
    values = dequantize(paddle.to_tensor(raw), qtype, k).numpy()
    assert np.isfinite(values).all() and np.abs(values).max() > 0


def _slow_where(slow_types: set[str], slow_logits: bool):
    """A timer: the kernel 2x the portable op, except on shapes of ``slow_types`` and, if
    ``slow_logits``, the lm_head (0.5x at its last row count)."""
    calls = []

    def time_shape(shape, *args):
        calls.append(shape)
        rows = list(op_timing.LOGITS_ROWS if shape.logits else op_timing.ROWS)
        slow = shape.weight_dtype in slow_types or (shape.logits and slow_logits)
        return {"rows": rows, "kernel": [25.0 if slow and r == rows[-1] else 100.0 for r in rows],
                "portable": [50.0] * len(rows)}
    return time_shape, calls


def _row_ops_and_stack_keep_their_kernels(monkeypatch) -> None:
    """Real timings of the row ops, the backends and the stack could split near ties differently
    between the engines a test compares (a tiny model's one-row calls; a backend losing one would
    keep the stack off)."""
    from fdplug.core.worker import backend_timing, row_op_timing, stack_timing

    monkeypatch.setattr(row_op_timing, "_time_case", kernel_wins)
    monkeypatch.setattr(backend_timing, "_time_case", kernel_wins)
    monkeypatch.setattr(stack_timing, "_time_steps", lambda *a: {"rows": [1, 32], "kernel": [1.0, 1.0],
                                                                 "portable": [2.0, 2.0]})


@NEEDS_KERNELS
def test_the_engine_runs_the_portable_gguf_op_on_the_groups_where_it_is_faster(tmp_path, monkeypatch, caplog):
    """A Q4_K_M-like mix: the groups of the losing type run the portable op on the file's bytes (the
    same numbers as the op itself), the others the kernel on its own layout; the tied lm_head too;
    the stack stays off; ``--op-kernel`` takes every shape again, and the stack with it."""
    from fdplug.core.frontend.llm import LLM
    from fdplug.plugin_api.sampling_params import SamplingParams

    monkeypatch.setenv("FDPLUG_OP_TIMING", "1")   # the tests' default pins the kernels (conftest)
    monkeypatch.setenv("FDPLUG_CACHE_DIR", str(tmp_path / "cache"))
    time_shape, calls = _slow_where({"Q6_K"}, slow_logits=True)
    monkeypatch.setattr(op_timing, "_time_shape", time_shape)
    _row_ops_and_stack_keep_their_kernels(monkeypatch)   # what this test asserts is the linears' plan
    gguf, _ = write_pair(tmp_path, "llama", types={"model.layers.*.self_attn.v_proj": "Q6_K",
                                                  "model.layers.*.mlp.down_proj": "Q6_K"}, tokenizer=True)
    with caplog.at_level("INFO"):
        llm = LLM(str(gguf), max_model_len=64, num_kv_blocks=16)
    model = llm.engine.runner.model
    chosen = llm.engine.runner.selection.ops["gguf_linear"].name
    assert {s.weight_dtype for s in calls} == {"Q8_0", "Q6_K"}
    qkv, down = model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.down_proj
    assert qkv.layout.groups == (("Q8_0", 384), ("Q6_K", 128))
    assert qkv.kernels[0] is not PORTABLE.gguf_linear and qkv.kernels[1] is PORTABLE.gguf_linear
    assert qkv.kernel_weights[1] is qkv.weight_1                      # the file's bytes, not laid out
    assert down.kernels == (PORTABLE.gguf_linear,) and down.kernel_weights == (down.weight,)
    if chosen == "cpu_native_gguf_packed_linear":                    # the only GGUF kernel with a layout
        assert isinstance(qkv.kernel_weights[0], PreparedWeight)
    assert model.gguf_kernel is PORTABLE.gguf_linear and model.head_weight is None   # the tied lm_head
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((3, down.in_features)).astype(np.float32))
    want = PORTABLE.gguf_linear(x, down.weight, "Q6_K", down.in_features)
    np.testing.assert_array_equal(down(x).numpy(), want.numpy())
    assert model.fused_stack is None
    log = caplog.text
    assert f"op:gguf_linear per layer shape (measured now): {chosen} on 3 of 6 shapes" in log
    assert "projection runs the portable op" in log
    out = llm.generate(["the quick brown fox"], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    calls.clear()
    pinned = LLM(str(gguf), max_model_len=64, num_kv_blocks=16, op_kernels={"gguf_linear": chosen})
    model = pinned.engine.runner.model
    assert not calls and PORTABLE.gguf_linear not in model.layers[0].self_attn.qkv_proj.kernels
    assert model.gguf_kernel is not PORTABLE.gguf_linear
    assert model.fused_stack is not None


@NEEDS_KERNELS
def test_the_engine_runs_the_portable_fp8_op_on_the_shapes_where_it_is_faster(test_model_dir, monkeypatch, tmp_path):
    """FP8 blocks (quantized at load): the losing shape's layers read their e4m3 weight as stored."""
    from fdplug.core.frontend.llm import LLM
    from fdplug.core.model.layers.linear_shapes import fp8_block_k

    monkeypatch.setenv("FDPLUG_OP_TIMING", "1")
    monkeypatch.setenv("FDPLUG_CACHE_DIR", str(tmp_path))
    calls = []

    def time_shape(shape, *args):
        calls.append(shape)
        slow = "down_proj" in shape.layers
        return {"rows": list(op_timing.ROWS), "kernel": [100.0, 100.0, 25.0 if slow else 100.0],
                "portable": [50.0] * 3}
    monkeypatch.setattr(op_timing, "_time_shape", time_shape)
    _row_ops_and_stack_keep_their_kernels(monkeypatch)
    llm = LLM(str(test_model_dir), max_model_len=64, num_kv_blocks=16, quantization="fp8")
    layer = llm.engine.runner.model.layers[0]
    fp8 = [s for s in calls if s.weight_dtype != "float32"]          # the float lm_head is the linear op's
    assert {n for s in fp8 for n in s.layers} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert all(fp8_block_k(s.weight_dtype) == 128 for s in fp8)
    assert layer.mlp.down_proj.kernel is PORTABLE.fp8_linear and layer.mlp.down_proj.prepared is None
    assert layer.self_attn.qkv_proj.kernel is not PORTABLE.fp8_linear
    assert isinstance(layer.self_attn.qkv_proj.kernel_weight, PreparedWeight)


@NEEDS_KERNELS
def test_explain_shows_the_real_figures_of_a_gguf_model(tmp_path, monkeypatch):
    monkeypatch.setenv("FDPLUG_OP_TIMING", "1")
    monkeypatch.setenv("FDPLUG_CACHE_DIR", str(tmp_path / "cache"))
    gguf, _ = write_pair(tmp_path, "llama", types={"model.layers.*.mlp.down_proj": "Q4_K"}, tokenizer=True)
    first = CliRunner().invoke(main, ["explain", "--model", str(gguf)])
    assert first.exit_code == 0, first.output
    lines = [line for line in first.output.splitlines() if "GFLOP/s at" in line]
    assert [line.split("(")[1].split(")")[0] for line in lines] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj",
                                                                    "lm_head"]
    assert "Q4_K (down_proj)" in lines[3] and "at 1/32 rows" in lines[4]          # the lm_head: sampled rows
    assert "op:gguf_linear per layer shape (measured now)" in first.output
    untimed = next((line for line in first.output.splitlines() if line.startswith("not timed against")), "")
    assert "gguf_linear=" not in untimed
    second = CliRunner().invoke(main, ["explain", "--model", str(gguf)])
    assert "op:gguf_linear per layer shape (cached figures)" in second.output
    named = CliRunner().invoke(main, ["explain", "--model", str(gguf), "--op-kernel",
                                      "gguf_linear=cpu_native_gguf_linear"])
    assert "op:gguf_linear per layer shape" not in named.output
    assert "gguf_linear=cpu_native_gguf_linear" in next(line for line in named.output.splitlines()
                                                        if line.startswith("not timed against"))


@NEEDS_KERNELS
def test_explain_shows_the_real_figures_of_fp8_layers(test_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FDPLUG_OP_TIMING", "1")
    monkeypatch.setenv("FDPLUG_CACHE_DIR", str(tmp_path))
    out = CliRunner().invoke(main, ["explain", "--model", str(test_model_dir), "--quantization", "fp8"])
    assert out.exit_code == 0, out.output
    fp8 = out.output.split("op:fp8_linear per layer shape (measured now)")[1].split("\nop:")[0]
    lines = [line for line in fp8.splitlines() if "GFLOP/s at 1/32/256 rows" in line]
    assert len(lines) == 4 and all("float8_e4m3fn, k blocks of 128" in line for line in lines)
    portable = [line.split(" vs paddle_fp8_linear ")[1].split(" GFLOP/s")[0].split("/") for line in lines]
    assert all(len(figures) == 3 and float(figures[-1]) > 0 for figures in portable)   # 1/32/256 rows, timed
