"""Selection that measures (`fdplug.core.worker.op_timing`): a ``linear`` kernel with an
`OpSpec.measure_key`, chosen by priority, runs only the layer shapes where it is not slower than the
portable op, as timed once per machine and cached; named with ``--op-kernel``, every shape.

The timer is replaced where a test needs a verdict (a machine's real figures decide nothing the
test could assert); the real one runs in `test_the_real_figures_are_cached_and_shown_by_explain`.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from fdplug.core.model.checkpoint.config import ModelConfig
from fdplug.core.model.layers.decoder import DecoderForCausalLM
from fdplug.core.model.layers.linear import Linear
from fdplug.core.model.layers.linear_shapes import LinearShape, linear_shapes
from fdplug.core.portable.ops import PORTABLE
from fdplug.core.worker import op_timing, timing_cache
from fdplug.plugin_api.ops import PreparedWeight
from fdplug.plugins.cpu import isa, kernels
from tests.conftest import explain_measuring

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
NEEDS_KERNELS = pytest.mark.skipif(kernels.unavailable_reason() is not None or isa.level() < 3,
                                   reason="the cpu linear kernels need their build and x86-64-v3 (FDPLUG_CPU_ISA)")


def _built_shapes(model: DecoderForCausalLM) -> set[tuple]:
    """The ``LinearShape.key`` of every linear the built decoder runs through the ``linear`` op."""
    keys = {(*layer.weight.shape, str(layer.weight.dtype).removeprefix("paddle."), True, layer is model.lm_head)
            for layer in model.sublayers() if isinstance(layer, Linear)}
    if model.lm_head is None:
        keys.add((*model.embed_tokens.shape, str(model.embed_tokens.dtype).removeprefix("paddle."), False, True))
    return {(int(n), int(k), dtype, prepared, logits) for n, k, dtype, prepared, logits in keys}


@pytest.mark.parametrize("name", sorted(p.name for p in GOLDEN.iterdir() if (p / "config.json").is_file()))
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_the_shapes_from_the_config_are_the_decoders_linears(name, weights):
    """Dense, MoE with and without shared experts, tied and untied lm_heads, bf16 weights: the
    shapes measured before load are exactly those the decoder builds."""
    cfg = ModelConfig.from_dir(GOLDEN / name).keep_weights("float32", weights)
    model = DecoderForCausalLM(cfg, attn_backend=None)
    assert {s.key for s in linear_shapes(cfg, "float32")} == _built_shapes(model)


def test_fp8_layers_are_not_linear_shapes():
    cfg = ModelConfig.from_dir(GOLDEN / "llama", quantization="fp8").keep_weights("float32", None)
    shapes = linear_shapes(cfg, "float32")
    assert [s.layers for s in shapes] == [("lm_head",)]              # every projection is an Fp8Linear
    assert shapes[0].key == _built_shapes(DecoderForCausalLM(cfg, attn_backend=None)).pop()


def _figures(slow: set[str]):
    """A timer: the kernel 2x the portable op, except on layers named in ``slow`` (0.5x at the most rows)."""
    calls: list[LinearShape] = []

    def time_shape(shape: LinearShape) -> dict[str, list]:
        calls.append(shape)
        rows = list(op_timing.LOGITS_ROWS if shape.logits else op_timing.ROWS)
        kernel = [100.0 if r != rows[-1] or not slow & set(shape.layers) else 25.0 for r in rows]
        return {"rows": rows, "kernel": kernel, "portable": [50.0] * len(rows)}
    return time_shape, calls


def _shape(name: str, n: int = 64, k: int = 32, logits: bool = False) -> LinearShape:
    return LinearShape(n, k, "float32", True, logits, (name,))


def test_a_shape_goes_to_the_kernel_only_where_it_is_not_slower_at_any_row_count(tmp_path):
    shapes = [_shape("qkv_proj"), _shape("down_proj", 32, 64), _shape("lm_head", 100, 32, logits=True)]
    time_shape, calls = _figures(slow={"down_proj"})
    figures, cached = timing_cache.measured(tmp_path / "t.json", "key", shapes, op_timing._name, time_shape)
    assert not cached and calls == shapes
    plan = op_timing.LinearPlan("k", "p", tuple(timing_cache.Timing.of(s, figures[op_timing._name(s)])
                                                for s in shapes), cached)
    assert [plan.uses_kernel(s) for s in shapes] == [True, False, True]
    text = plan.describe()
    assert "k on 2 of 3 shapes, p on the others" in text and "-> p (k slower at 256 rows)" in text
    assert "[64, 32] float32 (qkv_proj): k 100.0/100.0/100.0 vs p 50.0/50.0/50.0 GFLOP/s at 1/32/256 rows -> k" in text


def test_figures_are_cached_per_key_and_a_bad_file_is_measured_again(tmp_path):
    path, shapes = tmp_path / "t.json", [_shape("qkv_proj"), _shape("o_proj", 32, 32)]
    time_shape, calls = _figures(slow=set())
    timing_cache.measured(path, "key", shapes, op_timing._name, time_shape)
    _, cached = timing_cache.measured(path, "key", shapes, op_timing._name, time_shape)
    assert cached and len(calls) == 2                                   # nothing timed again
    timing_cache.measured(path, "key", [*shapes, _shape("gate_up_proj", 128, 32)], op_timing._name, time_shape)
    assert len(calls) == 3                                              # only the new shape
    timing_cache.measured(path, "another CPU", shapes, op_timing._name, time_shape)
    assert len(calls) == 5                                              # another key: all of them
    saved = json.loads(path.read_text())
    saved["shapes"][op_timing._name(shapes[0])]["kernel"] = ["fast"]    # edited by hand: not trusted
    path.write_text(json.dumps(saved))
    timing_cache.measured(path, "another CPU", shapes, op_timing._name, time_shape)
    assert len(calls) == 6
    path.write_text("{not json")
    timing_cache.measured(path, "another CPU", shapes, op_timing._name, time_shape)
    assert len(calls) == 8


def test_processes_starting_together_time_each_shape_once(tmp_path):
    """Under the file lock the second waits for the first's figures (flock is per open file, so two
    threads stand for two processes)."""
    shapes, calls, results = [_shape("qkv_proj")], [], []
    gate = threading.Event()

    def slow_timer(shape):
        calls.append(shape)
        gate.wait(5)
        return {"rows": [1], "kernel": [1.0], "portable": [2.0]}

    threads = [threading.Thread(target=lambda: results.append(timing_cache.measured(tmp_path / "t.json", "key",
                                                                                    shapes, op_timing._name,
                                                                                    slow_timer)))
               for _ in range(2)]
    for t in threads:
        t.start()
    threading.Timer(0.3, gate.set).start()
    for t in threads:
        t.join(30)
    assert len(calls) == 1 and sorted(cached for _, cached in results) == [False, True]
    assert results[0][0] == results[1][0]


def _engine(model_dir: Path, **kwargs):
    from fdplug.core.frontend.llm import LLM

    return LLM(str(model_dir), max_model_len=64, num_kv_blocks=64, **kwargs)


@NEEDS_KERNELS
def test_the_engine_runs_the_portable_op_on_the_shapes_where_it_is_faster(test_model_dir, tmp_path, monkeypatch):
    """Same tokens as the kernel everywhere; the losing shape keeps its [N, K] weight, the others are
    laid out for the kernel; the plan is in the startup log; ``--op-kernel`` takes every shape."""
    from fdplug.plugin_api.sampling_params import SamplingParams

    monkeypatch.setenv("FDPLUG_OP_TIMING", "1")   # the tests' default pins the kernels (conftest)
    monkeypatch.setenv("FDPLUG_CACHE_DIR", str(tmp_path))
    time_shape, calls = _figures(slow={"o_proj", "lm_head"})
    monkeypatch.setattr(op_timing, "_time_shape", lambda shape, *args: time_shape(shape))
    from tests.test_quant_op_timing import _row_ops_and_stack_keep_their_kernels

    _row_ops_and_stack_keep_their_kernels(monkeypatch)   # this test is about the linears' plan
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = ["the quick brown fox", "one two three four five six"]
    llm = _engine(test_model_dir)
    model = llm.engine.runner.model
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert calls and {s.layers[0] for s in calls} >= {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    layers = model.layers[0]
    assert layers.self_attn.o_proj.kernel is PORTABLE.linear and layers.self_attn.o_proj.prepared is None
    assert layers.self_attn.qkv_proj.kernel is not PORTABLE.linear
    assert isinstance(layers.self_attn.qkv_proj.kernel_weight, PreparedWeight)
    assert model.lm_head is None and model.logits_kernel is PORTABLE.linear   # the tied lm_head
    assert model.fused_stack is None         # o_proj on paddle's matmul: the stack needs every layer packed
    calls.clear()
    pinned = _engine(test_model_dir, op_kernels={"linear": "cpu_native_linear"})
    model = pinned.engine.runner.model
    want = [o.outputs[0].token_ids for o in pinned.generate(prompts, params, use_tqdm=False)]
    assert not calls                                                    # named: not measured
    assert model.layers[0].self_attn.o_proj.kernel is not PORTABLE.linear and model.logits_kernel is not PORTABLE.linear
    assert model.fused_stack is not None     # every layer packed: decode steps in one call
    assert got == want


@NEEDS_KERNELS
def test_the_real_figures_are_cached_and_shown_by_explain(test_model_dir, tmp_path, monkeypatch):
    first = explain_measuring(test_model_dir, tmp_path, monkeypatch)
    assert "(measured now)" in first
    lines = [line for line in first.splitlines() if "GFLOP/s at 1/32/256 rows" in line]
    assert len(lines) == 4 and all(line.rstrip().endswith(("cpu_native_linear", "cpu_native_bf16_linear"))
                                   or "slower at" in line for line in lines)
    second = explain_measuring(test_model_dir, tmp_path, monkeypatch)
    assert "(cached figures)" in second
    assert [line for line in second.splitlines() if "GFLOP/s" in line] == \
        [line for line in first.splitlines() if "GFLOP/s" in line]
    row_lines = [line for line in first.splitlines() if " us at 1/32" in line and line.endswith(" rows")]
    assert [line.split(" (")[0].strip() for line in row_lines] == ["[64]", "[64]", "[6, 16]", "[256]", "[512]"]
    assert [line for line in second.splitlines() if " us at " in line and line.endswith(" rows")] == row_lines
    saved = sorted((tmp_path / "op_timings").glob("*.json"))
    assert len(saved) == 7                                  # the linear kernel's, five row ops', the attention's
    assert all(v > 0 for path in saved for e in json.loads(path.read_text())["shapes"].values() for v in e["kernel"])
    assert not any(line.startswith("not timed against") for line in first.splitlines())   # every op timed
    assert "op:decoder_stack: cpu_native_decoder_stack is timed against the layers one by one" in first
    assert "attention backend (measured now; one layer's call) -> cpu_native" in first   # a dense model: no moe
    assert "attention backend (cached figures; one layer's call) -> cpu_native" in second
    named = explain_measuring(test_model_dir, tmp_path, monkeypatch, "--op-kernel", "linear=paddle_linear",
                              "--op-kernel", "swiglu=cpu_native_swiglu")
    assert "GFLOP/s" not in named and "per layer shape" not in named
    assert "op:swiglu" not in named.split("row ops per op")[1]           # named: untimed, and said so
    assert "swiglu=cpu_native_swiglu" in next(line for line in named.splitlines()
                                              if line.startswith("not timed against"))


def test_within_the_timings_noise_is_a_tie_and_beyond_it_a_loss():
    """Two GEMMs at the machine's peak measure a few percent apart either way: that must not cost
    a shape its kernel (and decode its speed-up); more than the noise does."""
    def timing(kernel_at_256: float) -> timing_cache.Timing:
        return timing_cache.Timing(_shape("gate_up_proj"), (1, 32, 256), (70.0, 220.0, kernel_at_256),
                                     (40.0, 190.0, 250.0))
    assert timing(250 * (1 - timing_cache.NOISE) + 0.5).kernel_wins
    assert timing(250 * (1 - timing_cache.NOISE) - 0.5).slower_at == (256,)


def test_a_failed_timing_gives_that_shape_the_portable_op_and_is_not_cached(tmp_path):
    path, shapes = tmp_path / "t.json", [_shape("qkv_proj"), _shape("o_proj", 32, 32)]
    time_shape, calls = _figures(slow=set())

    def failing(shape):
        return None if "o_proj" in shape.layers else time_shape(shape)

    figures, cached = timing_cache.measured(path, "key", shapes, op_timing._name, failing)
    assert not cached and set(figures) == {op_timing._name(shapes[0])}
    plan = op_timing.LinearPlan("k", "p", tuple(timing_cache.Timing.of(s, figures.get(op_timing._name(s),
                                                                                        timing_cache.NO_FIGURES))
                                                for s in shapes), cached)
    assert [plan.uses_kernel(s) for s in shapes] == [True, False]
    assert "(o_proj): timing failed (see the log) -> p" in plan.describe()
    _, cached = timing_cache.measured(path, "key", shapes, op_timing._name, time_shape)
    assert not cached and len(calls) == 2                               # the failed one timed again, only it


def test_no_usable_cache_directory_means_timing_without_one(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    time_shape, calls = _figures(slow=set())
    figures, cached = timing_cache.measured(tmp_path / "file" / "op_timings" / "t.json", "key",
                                            [_shape("qkv_proj")], op_timing._name, time_shape)
    assert not cached and len(calls) == 1 and len(figures) == 1


def test_a_lock_held_past_the_timeout_means_no_timing(tmp_path, monkeypatch):
    import fcntl

    path = tmp_path / "t.json"
    monkeypatch.setattr(timing_cache, "LOCK_TIMEOUT_S", 0.2)
    time_shape, calls = _figures(slow=set())
    with open(path.with_suffix(".lock"), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert timing_cache.measured(path, "key", [_shape("qkv_proj")], op_timing._name, time_shape) is None
    assert not calls


def test_fdplug_op_timing_0_and_an_explicit_kernel_are_not_timed(monkeypatch):
    from fdplug.core.plugin_loading.selection import select_components

    if kernels.unavailable_reason() is not None or isa.level() < 3:
        pytest.skip("the cpu linear kernels need their build and x86-64-v3")
    monkeypatch.setenv("FDPLUG_OP_TIMING", "1")
    row_ops = {"rms_norm", "add_rms_norm", "rope", "swiglu", "argmax"}
    others = {"linear", "fp8_linear", "gguf_linear", "decoder_stack", "attention", "moe"}   # and the backends
    assert select_components("cpu").measured_ops == others | row_ops
    assert select_components("cpu", ops={"linear": "cpu_native_linear"}).measured_ops == \
        others - {"linear"} | row_ops
    assert select_components("cpu", ops={"swiglu": "cpu_native_swiglu"}).measured_ops == \
        others | row_ops - {"swiglu"}
    monkeypatch.setenv("FDPLUG_OP_TIMING", "0")
    selection = select_components("cpu")
    assert selection.measured_ops == frozenset() and selection.to_names()["measured_ops"] == []
    rebuilt = select_components(**select_components("cpu", measured_ops=["linear"]).to_names())
    assert rebuilt.measured_ops == {"linear"}                           # another process follows the names


def test_only_the_measured_ops_kernels_may_name_a_measure_key():
    from fdplug.plugin_api.spec_checks import validate_spec
    from fdplug.plugin_api.specs import OpSpec

    for op in ("linear", "fp8_linear", "gguf_linear", "rms_norm", "add_rms_norm", "rope", "swiglu", "argmax",
               "decoder_stack"):
        validate_spec(OpSpec(name="x", op=op, devices=("cpu",), factory=lambda c: None, measure_key=lambda c: "k"),
                      OpSpec)
    with pytest.raises(ValueError, match="only linear, fp8_linear, gguf_linear, rms_norm, add_rms_norm, rope, swiglu, "
                                         "argmax, decoder_stack kernels are timed"):
        validate_spec(OpSpec(name="x", op="vision_attention", devices=("cpu",), factory=lambda c: None,
                             measure_key=lambda c: "k"), OpSpec)


def test_explain_says_when_the_plan_keeps_the_fused_stack_off():
    """A decoder layer's shape on the portable op keeps the stack off (it runs packed layers only);
    the lm_head's does not (the stack never runs it); no hint without a stack selected."""
    from fdplug.cli.explain import _stack_hint
    from fdplug.core.plugin_loading.selection import select_components

    if kernels.unavailable_reason() is not None:
        pytest.skip("the cpu kernels (and their decoder stack) need their build")

    def plan(losing: str) -> op_timing.LinearPlan:
        shapes = [_shape("qkv_proj"), _shape("lm_head", 100, 32, logits=True)]
        time_shape, _ = _figures(slow={losing})
        return op_timing.LinearPlan("k", "p", tuple(timing_cache.Timing.of(s, time_shape(s)) for s in shapes), False)

    selection = select_components("cpu")
    assert selection.ops["decoder_stack"].name == "cpu_native_decoder_stack"
    hint = _stack_hint(plan("qkv_proj"), selection)
    assert "the layers on p keep cpu_native_decoder_stack off" in hint and "--op-kernel linear=k" in hint
    assert _stack_hint(plan("lm_head"), selection) is None
    assert _stack_hint(plan("qkv_proj"), select_components("cpu", ops={"decoder_stack": "paddle_layer_by_layer"})) \
        is None


def _scripted_timer(monkeypatch):
    """``median_seconds`` on scripted seconds: -> (a call of it on ``kernel``/``portable`` series, the
    windows each was timed in)."""
    timed = {"kernel": [], "portable": []}
    results = {}

    def fake(call, sync):
        name = call()
        timed[name].append(1)
        return next(results[name])

    monkeypatch.setattr(timing_cache, "_seconds", fake)
    calls = {"kernel": lambda: "kernel", "portable": lambda: "portable"}

    def run(kernel: list[float], portable: list[float]) -> dict[str, float]:
        timed.update(kernel=[], portable=[])
        results.update(kernel=iter([9.0, *kernel]), portable=iter([9.0, *portable]))   # the untimed round first
        return timing_cache.median_seconds(calls, lambda: None)
    return run, timed


def test_a_verdict_that_hinges_is_timed_twice_as_long(monkeypatch):
    """An untimed round each first (allocators settle); then PAIRS alternated rounds, and PAIRS more
    only where the kernel looks slower beyond the noise, the medians taken over all of them."""
    run, timed = _scripted_timer(monkeypatch)
    pairs = timing_cache.PAIRS
    assert run([1.0] * 2 * pairs, [1.0] * 2 * pairs) == {"kernel": 1.0, "portable": 1.0}
    assert len(timed["kernel"]) == len(timed["portable"]) == 1 + pairs                # a tie: decided
    slow_then_fast = [1.2] * pairs + [0.9] * pairs                                    # looked slower, then was not
    got = run(slow_then_fast, [1.0] * 2 * pairs)
    assert len(timed["kernel"]) == 1 + 2 * pairs and got == {"kernel": (1.2 + 0.9) / 2, "portable": 1.0}


def test_a_kernel_far_ahead_in_the_first_pair_is_decided_by_it(monkeypatch):
    """DECISIVE times faster: one pair after the untimed round; slower by as much: every pair (the
    choice it would change gets the whole evidence)."""
    run, timed = _scripted_timer(monkeypatch)
    pairs, far = timing_cache.PAIRS, timing_cache.DECISIVE
    assert run([1.0] * 2 * pairs, [far] * 2 * pairs) == {"kernel": 1.0, "portable": far}
    assert len(timed["kernel"]) == len(timed["portable"]) == 2
    run([far] * 2 * pairs, [1.0] * 2 * pairs)
    assert len(timed["kernel"]) == len(timed["portable"]) == 1 + 2 * pairs


def test_a_window_is_three_calls_unless_one_call_is_long_already():
    """Short calls: at least MIN_CALLS a window, against a single slow one; a call past LONG_WINDOW_S
    (the reference MoE over big GGUF experts: seconds) is its own window, so that a startup timing of
    slow portable calls does not take three times as long."""
    import time

    counts = []

    def timed(seconds: float) -> float:
        counts.append(0)

        def call() -> None:
            counts[-1] += 1
            time.sleep(seconds)
        return timing_cache._seconds(call, lambda: None)
    assert timed(0.0) < timing_cache.CALL_SECONDS and counts[-1] >= timing_cache.MIN_CALLS
    timed(timing_cache.LONG_WINDOW_S / 4)                      # past CALL_SECONDS, short of a long window
    assert counts[-1] == timing_cache.MIN_CALLS
    assert timed(timing_cache.LONG_WINDOW_S * 1.05) >= timing_cache.LONG_WINDOW_S and counts[-1] == 1
