"""Selection that measures, for the row ops (`fdplug.core.worker.row_op_timing`): a kernel of
``rms_norm``, ``add_rms_norm``, ``rope``, ``swiglu`` or ``argmax`` with an `OpSpec.measure_key`,
chosen by priority, keeps the op only where it is not slower than the portable op on any shape the
model gives it; else the whole op runs the portable one, in the selection, the kernel table and
every layer, and a fused decoder stack that runs those ops declines. Where a stack runs the decode
steps, the ops inside it are judged without their one-row figure.

The timer is replaced where a test needs a verdict (a machine's figures decide nothing a test could
assert); the real one runs in tests/test_op_timing.py's explain test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fdplug.core.model.checkpoint.config import ModelConfig
from fdplug.core.model.layers.basic import RMSNorm, RotaryEmbedding, SwiGLU
from fdplug.core.model.layers.decoder import DecoderForCausalLM
from fdplug.core.model.layers.fused_stack import OPS_INSIDE
from fdplug.core.portable.ops import PORTABLE
from fdplug.core.worker import op_timing, row_op_timing
from fdplug.core.worker.timing_cache import Timing
from fdplug.plugins.cpu import isa, kernels

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
NEEDS_KERNELS = pytest.mark.skipif(kernels.unavailable_reason() is not None,
                                   reason="the cpu row-op kernels need their build")
ROW_OPS = ("rms_norm", "add_rms_norm", "rope", "swiglu", "argmax")


def _called_widths(model: DecoderForCausalLM) -> set[tuple]:
    """(op, a row's shape) of every row-op call the built decoder makes, read from its layers."""
    found = {("argmax", (model.config.vocab_size,))}
    for layer in model.sublayers():
        if isinstance(layer, RMSNorm):
            found.add(("rms_norm", tuple(layer.weight.shape)))
            if len(layer.weight.shape) == 1:          # the pre-norm blocks' residual add + norm
                found.add(("add_rms_norm", tuple(layer.weight.shape)))
        elif isinstance(layer, SwiGLU):
            found.add(("swiglu", (layer.gate_up_proj.weight.shape[0],)))
        elif isinstance(layer, RotaryEmbedding):
            found.add(("rope", (layer.heads, model.config.head_dim)))
    return found


@pytest.mark.parametrize("name", sorted(p.name for p in GOLDEN.iterdir() if (p / "config.json").is_file()))
def test_the_cases_from_the_config_are_the_shapes_the_decoder_gives_the_ops(name):
    """Dense, MoE with and without shared experts and dense layers, Qwen3's q/k norm: each op is
    timed on exactly the widths its layers call it with."""
    cfg = ModelConfig.from_dir(GOLDEN / name).keep_weights("float32", None)
    model = DecoderForCausalLM(cfg, attn_backend=None)
    assert {(c.op, c.width) for c in row_op_timing.row_cases(cfg)} == _called_widths(model)


def _timing(op: str, width: tuple[int, ...], kernel: tuple[float, ...], portable: tuple[float, ...]) -> Timing:
    rows = (1, 32) if op == "argmax" else (1, 32, 256)
    return Timing(row_op_timing.RowCase(op, width, "w"), rows, kernel, portable, "us")


def _plan(slow: dict[str, tuple[int, ...]], failed: tuple[str, ...] = ()) -> row_op_timing.RowOpsPlan:
    """Every op's kernel at half the portable op's microseconds, but 1.5x at the rows named in ``slow``."""
    from fdplug.core.portable.op_specs import PORTABLE_OPS

    timings = []
    for op in ROW_OPS:
        rows = (1, 32) if op == "argmax" else (1, 32, 256)
        kernel = tuple(15.0 if r in slow.get(op, ()) else 5.0 for r in rows)
        timings.append(Timing(row_op_timing.RowCase(op, (8,), "w"), () if op in failed else rows,
                              () if op in failed else kernel, () if op in failed else (10.0,) * len(rows), "us"))
    return row_op_timing.RowOpsPlan({op: f"k_{op}" for op in ROW_OPS}, {op: PORTABLE_OPS[op] for op in ROW_OPS},
                                    tuple(timings), cached=False)


def test_microseconds_compare_the_other_way_round_within_the_noise():
    assert _timing("swiglu", (8,), (10.4, 5.0, 5.0), (10.0, 10.0, 10.0)).kernel_wins       # 4% slower: a tie
    assert _timing("swiglu", (8,), (10.6, 5.0, 5.0), (10.0, 10.0, 10.0)).slower_at == (1,)
    assert _timing("swiglu", (8,), (20.0, 5.0, 5.0), (10.0, 10.0, 10.0)).slower_at == (1,)
    assert not _timing("argmax", (8,), (5.0, 5.0), (10.0, 10.0)).slower_at


def test_an_op_slower_on_one_shape_at_one_row_count_runs_the_portable_op_everywhere():
    plan = _plan({"swiglu": (256,), "rope": (1,)}, failed=("argmax",))
    assert plan.losing() == ["rope", "swiglu", "argmax"]
    text = plan.describe()
    assert "op:rms_norm -> k_rms_norm\n" in text
    assert "op:swiglu -> paddle_swiglu (k_swiglu slower on [8] (w) at 256 rows)" in text
    assert "op:argmax -> paddle_argmax (k_argmax slower on [8] (w): timing failed)" in text
    assert "[8] (w): k_swiglu 5.0/5.0/15.0 vs paddle_swiglu 10.0/10.0/10.0 us at 1/32/256 rows" in text
    assert "the kernel on 2 of 5" in text


def test_with_a_fused_stack_the_ops_inside_it_are_judged_without_the_decode_row():
    """A decode step's layers run in the stack: their norms, RoPE and SwiGLU are not called at one
    row; the final norm's add_rms_norm and the sampler's argmax still are."""
    assert set(OPS_INSIDE) == {"rms_norm", "rope", "swiglu"}
    plan = _plan({op: (1,) for op in ROW_OPS})
    assert plan.losing() == list(ROW_OPS)
    assert plan.losing(OPS_INSIDE) == ["add_rms_norm", "argmax"]
    assert _plan({"swiglu": (1, 32)}).losing(OPS_INSIDE) == ["swiglu"]             # a mixed step's rows count
    assert "op:swiglu -> k_swiglu (slower on [8] (w) at 1 rows: one decode row, which the fused decoder stack " \
           "runs)" in plan.describe(OPS_INSIDE)
    unknown = plan.describe(in_stack=None)    # explain: not loaded, so both verdicts
    assert ("op:swiglu -> paddle_swiglu (k_swiglu slower on [8] (w) at 1 rows); where a fused decoder stack runs "
            "the decode steps (the log says): -> k_swiglu") in unknown
    assert "op:argmax -> paddle_argmax (k_argmax slower on [8] (w) at 1 rows)\n" in unknown


def _times(slow: dict[str, tuple[int, ...]]):
    """A replacement for `row_op_timing._time_case`: the kernel 2x faster, but 2x slower at ``slow``'s rows."""
    calls = []

    def time_case(case, kernel, portable, place, dtype):
        calls.append(case)
        return {"rows": list(case.rows), "kernel": [20.0 if r in slow.get(case.op, ()) else 5.0 for r in case.rows],
                "portable": [10.0] * len(case.rows)}
    return time_case, calls


def _kernels_in_layers(model) -> set:
    """Every row-op callable the model's layers hold."""
    held = set()
    for layer in model.sublayers(include_self=True):
        for attr in ("kernel", "add_kernel", "activation"):
            if isinstance(layer, (RMSNorm, SwiGLU, RotaryEmbedding)) and hasattr(layer, attr):
                held.add(getattr(layer, attr))
    return held


def _engine(model_dir, tmp_path, monkeypatch, slow, **kwargs):
    from fdplug.core.frontend.llm import LLM

    monkeypatch.setenv("FDPLUG_OP_TIMING", "1")   # the tests' default pins the kernels (conftest)
    monkeypatch.setenv("FDPLUG_CACHE_DIR", str(tmp_path / "cache"))
    time_case, calls = _times(slow)
    monkeypatch.setattr(row_op_timing, "_time_case", time_case)
    # the linears keep their kernels on every shape (their plan is tests/test_op_timing.py's): a real
    # timing could send a shape to the portable op in one engine and not in the next
    monkeypatch.setattr(op_timing, "_time_shape", lambda shape, *args: {"rows": [1], "kernel": [2.0],
                                                                         "portable": [1.0]})
    return LLM(str(model_dir), max_model_len=64, num_kv_blocks=32, max_num_seqs=4, **kwargs), calls


def _tokens(llm) -> list:
    from fdplug.plugin_api.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 200, 3, 99], [7, 8], [42, 43, 44])]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, [params] * 3, use_tqdm=False)]


@NEEDS_KERNELS
def test_a_losing_op_runs_the_portable_op_in_every_layer(test_model_dir, tmp_path, monkeypatch):
    """The same tokens as with that op named portable; the other ops keep their kernels; the
    figures are cached; ``--op-kernel`` keeps a kernel untimed."""
    llm, calls = _engine(test_model_dir, tmp_path, monkeypatch, {"swiglu": (32,), "argmax": (1,)})
    runner = llm.engine.runner
    assert {c.op for c in calls} == set(ROW_OPS)
    assert runner.selection.ops["swiglu"].name == "paddle_swiglu" and runner.selection.ops["argmax"].name == \
        "paddle_argmax"
    assert runner.selection.ops["rms_norm"].name == "cpu_native_rms_norm"
    held = _kernels_in_layers(runner.model)
    assert PORTABLE.swiglu in held and PORTABLE.rms_norm not in held and PORTABLE.rope not in held
    assert all(layer.activation is PORTABLE.swiglu for layer in runner.model.sublayers() if isinstance(layer, SwiGLU))
    assert runner.argmax is PORTABLE.argmax
    assert llm.engine.selection is runner.selection and "swiglu:paddle_swiglu" in llm.describe()   # as it runs
    got = _tokens(llm)
    pinned, calls = _engine(test_model_dir, tmp_path, monkeypatch, {},
                            op_kernels={"swiglu": "paddle_swiglu", "argmax": "paddle_argmax"})
    assert not calls                                    # the others' figures cached, the two named: untimed
    assert pinned.engine.runner.selection.ops["rms_norm"].name == "cpu_native_rms_norm"
    assert got == _tokens(pinned)


@NEEDS_KERNELS
@pytest.mark.skipif(isa.level_reason("cpu_native_gguf_linear", 3) is not None,
                    reason="the fused decoder stack runs the GGUF kernels chosen from x86-64-v3")
def test_a_fused_stack_keeps_its_ops_unless_they_lose_outside_decode(tmp_path, monkeypatch):
    """A GGUF model whose decode steps run in the stack: an op slower at one row keeps its kernel (and
    the stack stays); one slower at 32 rows goes portable, the stack declines, and the decode row's
    figures count again (rms_norm, slower at one row, then goes portable too), with the same tokens
    as those ops named portable."""
    from fdplug.testing.gguf_kit import write_pair

    gguf, _ = write_pair(tmp_path, "llama", types={"model.layers.*.mlp.up_proj": "Q4_K"}, tokenizer=True)
    stacked, _ = _engine(gguf, tmp_path / "a", monkeypatch, {"swiglu": (1,), "rms_norm": (1,), "argmax": (1,)})
    runner = stacked.engine.runner
    assert runner.model.fused_stack is not None
    assert [runner.selection.ops[op].name for op in ("swiglu", "rms_norm", "argmax")] == \
        ["cpu_native_swiglu", "cpu_native_rms_norm", "paddle_argmax"]
    declined, _ = _engine(gguf, tmp_path / "b", monkeypatch, {"swiglu": (32,), "rms_norm": (1,)})
    runner = declined.engine.runner
    assert runner.model.fused_stack is None
    assert [runner.selection.ops[op].name for op in ("swiglu", "rms_norm", "rope")] == \
        ["paddle_swiglu", "paddle_rms_norm", "cpu_native_rope"]
    assert {PORTABLE.swiglu, PORTABLE.rms_norm} <= _kernels_in_layers(runner.model)
    named, _ = _engine(gguf, tmp_path / "c", monkeypatch, {},
                       op_kernels={"swiglu": "paddle_swiglu", "rms_norm": "paddle_rms_norm"})
    assert named.engine.runner.model.fused_stack is None
    assert _tokens(declined) == _tokens(named)
