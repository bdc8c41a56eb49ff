"""Selection that measures, for the ``decoder_stack`` op (`fdplug.core.worker.stack_timing`): once
a fused stack has taken the loaded model, its decode steps are timed against the layers one by one,
and where it is slower it is let go (the same tokens: it is bit for bit the layers' result).

The timers are replaced where a test needs a verdict; the real one runs in
`test_the_real_figures_are_cached_and_shown_by_explain`.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fdplug.cli import main
from fdplug.core.worker import backend_timing, op_timing, row_op_timing, stack_timing
from fdplug.plugins.cpu import isa, kernels
from fdplug.testing.gguf_kit import write_pair
from tests.conftest import kernel_wins

pytestmark = pytest.mark.skipif(kernels.unavailable_reason() is not None
                                or isa.level_reason("cpu_native_gguf_linear", 3) is not None,
                                reason="the fused decoder stack runs the GGUF kernels chosen from x86-64-v3")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path, _ = write_pair(tmp_path_factory.mktemp("stack"), "llama", types={"model.layers.*.mlp.up_proj": "Q4_K"},
                         tokenizer=True)
    return path


def _engine(model, cache, monkeypatch, stack_us=None, swiglu_slower_at_one=False, **kwargs):
    """An engine measuring its ops into ``cache`` (`_pin_timings`)."""
    from fdplug.core.frontend.llm import LLM

    _pin_timings(cache, monkeypatch, stack_us, swiglu_slower_at_one)
    return LLM(str(model), max_model_len=64, num_kv_blocks=32, max_num_seqs=4, **kwargs)


def _pin_timings(cache, monkeypatch, stack_us=None, swiglu_slower_at_one=False) -> None:
    """Startup timing on, its figures cached under ``cache``: the linears, the row ops and the backends
    win (the row ops' SwiGLU slower at one row if asked); the stack's decode steps take ``stack_us``
    (its figures against the layers' 100 us at 1 and 32 sequences; None: the real timing)."""
    monkeypatch.setenv("FDPLUG_OP_TIMING", "1")   # the tests' default pins the kernels (conftest)
    monkeypatch.setenv("FDPLUG_CACHE_DIR", str(cache))
    monkeypatch.setattr(op_timing, "_time_shape", lambda shape, *a: {"rows": [1], "kernel": [2.0], "portable": [1.0]})

    def row_case(case, *args):
        slow = swiglu_slower_at_one and case.op == "swiglu"
        return {"rows": list(case.rows), "kernel": [3.0 if slow and r == 1 else 1.0 for r in case.rows],
                "portable": [2.0] * len(case.rows)}
    monkeypatch.setattr(row_op_timing, "_time_case", row_case)
    monkeypatch.setattr(backend_timing, "_time_case", kernel_wins)   # the backends win
    if stack_us is not None:
        monkeypatch.setattr(stack_timing, "_time_steps", lambda *a: {"rows": [1, 32], "kernel": list(stack_us),
                                                                     "portable": [100.0, 100.0]})


def _tokens(llm) -> list:
    from fdplug.plugin_api.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 200, 3, 99], [7, 8], [42, 43, 44])]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, [params] * 3, use_tqdm=False)]


def test_a_stack_slower_than_the_layers_is_let_go(gguf, tmp_path, monkeypatch, caplog):
    """Slower with a batch: the layers run one by one, the selection says so, the ops inside the
    stack are judged at one decode row again (SwiGLU, slower there, goes portable); the tokens are
    those of the stack kept."""
    kept = _engine(gguf, tmp_path / "a", monkeypatch, stack_us=(40.0, 90.0), swiglu_slower_at_one=True)
    runner = kept.engine.runner
    assert runner.model.fused_stack is not None
    assert runner.selection.ops["decoder_stack"].name == "cpu_native_decoder_stack"
    assert runner.selection.ops["swiglu"].name == "cpu_native_swiglu"    # not called at one row in the stack
    with caplog.at_level("INFO"):
        slower = _engine(gguf, tmp_path / "b", monkeypatch, stack_us=(40.0, 120.0), swiglu_slower_at_one=True)
    runner = slower.engine.runner
    assert runner.model.fused_stack is None
    assert runner.selection.ops["decoder_stack"].name == "paddle_layer_by_layer"
    assert runner.selection.ops["swiglu"].name == "paddle_swiglu"
    assert "decoder_stack:paddle_layer_by_layer" in slower.describe()
    assert ("op:decoder_stack (measured now; a decode step, each sequence a KV block of context): "
            "cpu_native_decoder_stack 40.0/120.0 vs paddle_layer_by_layer 100.0/100.0 us at 1/32 sequences -> "
            "paddle_layer_by_layer (cpu_native_decoder_stack slower at 32 sequences)") in caplog.text
    assert _tokens(slower) == _tokens(kept)


def test_a_failed_timing_lets_the_stack_go_and_a_named_stack_is_not_timed(gguf, tmp_path, monkeypatch):
    def failing(*args):
        raise RuntimeError("no memory for the timing's KV cache")
    monkeypatch.setattr(stack_timing, "_time_steps", failing)
    failed = _engine(gguf, tmp_path / "a", monkeypatch)
    assert failed.engine.runner.model.fused_stack is None
    calls = []
    monkeypatch.setattr(stack_timing, "_time_steps", lambda *a: calls.append(a))
    named = _engine(gguf, tmp_path / "b", monkeypatch, op_kernels={"decoder_stack": "cpu_native_decoder_stack"})
    assert not calls and named.engine.runner.model.fused_stack is not None


def test_the_real_figures_are_cached_and_shown_by_explain(gguf, tmp_path, monkeypatch, caplog):
    # pinned for explain too: it caches the linears' figures, and a real near tie of a tiny layer's
    # there had kept the stack off (seen under -n 2)
    _pin_timings(tmp_path, monkeypatch)
    before = CliRunner().invoke(main, ["explain", "--model", str(gguf)])
    assert "op:decoder_stack: cpu_native_decoder_stack is timed against the layers one by one once the model is " \
           "loaded" in before.output
    with caplog.at_level("INFO"):
        first = _engine(gguf, tmp_path, monkeypatch)
    line = next(line for line in caplog.text.splitlines() if "op:decoder_stack (measured now" in line)
    figures = line.split("): ")[1].split(" us at ")[0]
    stack, layers = (part.split(" ")[-1].split("/") for part in figures.split(" vs "))
    assert len(stack) == len(layers) == 2 and all(float(v) > 0 for v in (*stack, *layers))
    assert (first.engine.runner.model.fused_stack is not None) == line.endswith("-> cpu_native_decoder_stack")
    caplog.clear()
    with caplog.at_level("INFO"):
        _engine(gguf, tmp_path, monkeypatch)
    assert "op:decoder_stack (cached figures" in caplog.text
    after = CliRunner().invoke(main, ["explain", "--model", str(gguf)])
    shown = next(line for line in after.output.splitlines() if line.startswith("op:decoder_stack (cached figures"))
    assert shown.split("): ")[1] == line.split("): ")[1]
