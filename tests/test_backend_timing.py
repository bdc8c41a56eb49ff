"""Selection that measures, for the attention and MoE backends (`fdplug.core.worker.backend_timing`,
plugin API 4.7): a backend chosen by priority that names a ``measure_key`` is timed against the
core's reference before the model is built, and where it is slower the reference runs.

The timer is replaced where a test needs a verdict; the real one runs in
`test_the_real_figures_are_cached_and_shown_by_explain`.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from fdplug import select_components
from fdplug.core.config import EngineConfig
from fdplug.core.model.checkpoint.config import ModelConfig
from fdplug.core.worker import backend_timing
from fdplug.core.worker.expert_samples import ExpertFormat, expert_formats, experts_call
from fdplug.plugin_api.spec_checks import validate_spec
from fdplug.plugin_api.specs import AttentionBackendSpec, MoEBackendSpec
from fdplug.plugins.cpu import kernels
from fdplug.testing.gguf_kit import write_pair
from tests.conftest import explain_measuring, write_test_model
from tests.test_gguf_moe import CASES as GGUF_MOE
from tests.test_moe_models import QWEN3_MOE

NEEDS_KERNELS = pytest.mark.skipif(kernels.unavailable_reason() is not None, reason="the cpu kernels do not build here")


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return write_test_model(tmp_path_factory.mktemp("backend_timing") / "qwen3_moe", **QWEN3_MOE)


def _engine(model, cache, monkeypatch, slower=(), **kwargs):
    """An engine measuring into ``cache``: the ops keep their kernels; the backends of the roles in
    ``slower`` take 2 us a call against the reference's 1, the others 1 against 2."""
    from fdplug.core.frontend.llm import LLM
    from fdplug.core.worker import op_timing, row_op_timing, stack_timing

    monkeypatch.setenv("FDPLUG_OP_TIMING", "1")
    monkeypatch.setenv("FDPLUG_CACHE_DIR", str(cache))
    monkeypatch.setattr(op_timing, "_time_shape", lambda shape, *a: {"rows": [1], "kernel": [2.0], "portable": [1.0]})
    monkeypatch.setattr(row_op_timing, "_time_case", lambda case, *a: {"rows": [1], "kernel": [1.0],
                                                                       "portable": [2.0]})
    monkeypatch.setattr(stack_timing, "_time_steps", lambda *a: {"rows": [1], "kernel": [1.0], "portable": [2.0]})

    def time_case(case, backends, sync):
        role = "attention" if case.name.startswith(("decode", "prefill")) else "moe"
        kernel = [2.0 if role in slower else 1.0] * len(case.rows)
        return {"rows": list(case.rows), "kernel": kernel, "portable": [1.5] * len(case.rows)}
    monkeypatch.setattr(backend_timing, "_time_case", time_case)
    return LLM(str(model), max_model_len=64, num_kv_blocks=32, max_num_seqs=4, **kwargs)


def _tokens(llm) -> list:
    from fdplug.plugin_api.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 200, 3, 99], [7, 8], [42, 43, 44])]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, [params] * 3, use_tqdm=False)]


def test_the_backends_chosen_by_priority_are_measured_and_those_named_are_not(monkeypatch):
    monkeypatch.setenv("FDPLUG_OP_TIMING", "1")
    monkeypatch.delenv("FD_MOE_BACKEND", raising=False)
    chosen = select_components("cpu")
    assert chosen.attention.name == chosen.moe.name == "cpu_native"
    assert {"attention", "moe"} <= chosen.measured_ops
    assert select_components(**chosen.to_names()).measured_ops == chosen.measured_ops   # the engine process's
    named = select_components("cpu", attention="cpu_native")
    assert "attention" not in named.measured_ops and "moe" in named.measured_ops
    monkeypatch.setenv("FD_MOE_BACKEND", "cpu_native")
    assert "moe" not in select_components("cpu").measured_ops                # the variable names it too
    monkeypatch.setenv("FDPLUG_OP_TIMING", "0")
    assert not {"attention", "moe"} & select_components("cpu").measured_ops
    reference = select_components("cpu", attention="reference", moe="reference", measured_ops=["attention", "moe"])
    assert not {"attention", "moe"} & reference.measured_ops             # no measure_key: nothing to time


def test_a_backend_measure_key_must_be_callable():
    for spec_type in (AttentionBackendSpec, MoEBackendSpec):
        validate_spec(spec_type(name="x", devices=("cpu",), factory=lambda c: None, measure_key=lambda c: "k"),
                      spec_type)
        with pytest.raises(TypeError, match="measure_key of 'x' must be callable"):
            validate_spec(spec_type(name="x", devices=("cpu",), factory=lambda c: None, measure_key="k"), spec_type)


@NEEDS_KERNELS
@pytest.mark.parametrize("slower", [("attention",), ("moe",), ("attention", "moe")])
def test_a_backend_slower_than_the_reference_gives_way_to_it(moe_model, tmp_path, monkeypatch, caplog, slower):
    """The losing role runs the reference from the first step (the selection, the layers, the log
    say so), with the tokens of an engine that named the reference for it; the other keeps its backend."""
    with caplog.at_level(logging.INFO):
        llm = _engine(moe_model, tmp_path, monkeypatch, slower=slower)
    runner = llm.engine.runner
    for role in ("attention", "moe"):
        want = "reference" if role in slower else "cpu_native"
        assert getattr(runner.selection, role).name == want
        assert f"{role}={want}" in llm.describe()
        lost = ("reference (cpu_native slower on decode, 64 keys a sequence at 1/32 sequences; prefill at 64 tokens)"
                if role == "attention" else "reference (cpu_native slower on routed experts at 1/32/256 tokens)")
        assert f"{role} backend (measured now; one layer's call) -> " + (
            lost if role in slower else "cpu_native") in caplog.text
    assert type(runner.attn_backend).__name__ == ("ReferenceAttention" if "attention" in slower else
                                                  "NativeCpuAttention")
    assert type(runner.model.layers[0].mlp.backend).__name__ == ("ReferenceMoE" if "moe" in slower else "NativeCpuMoE")
    assert "routed experts: 16 of 16 experts x [24, 64], top 4, float32" in caplog.text
    named = {f"{role}_backend": "reference" for role in slower}
    assert _tokens(llm) == _tokens(_engine(moe_model, tmp_path / "named", monkeypatch, **named))


@NEEDS_KERNELS
def test_a_failed_timing_gives_the_role_the_reference(test_model_dir, tmp_path, monkeypatch, caplog):
    from fdplug.plugins.cpu.native_attention import NativeCpuAttention

    def broken(*args):
        raise RuntimeError("no kernel for this shape")
    monkeypatch.setenv("FDPLUG_OP_TIMING", "1")
    monkeypatch.setenv("FDPLUG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(NativeCpuAttention, "forward", broken)
    selection, config = select_components("cpu"), EngineConfig(max_model_len=64, dtype="float32")
    with caplog.at_level(logging.WARNING):
        settled = backend_timing.settle(selection, config, ModelConfig.from_dir(test_model_dir))
    assert settled.attention.name == "reference" and settled.moe.name == "cpu_native"   # a dense model: moe untimed
    assert "timing attention backend cpu_native on decode, 64 keys a sequence" in caplog.text
    plan, = backend_timing.plan_backends(selection, config, ModelConfig.from_dir(test_model_dir))
    assert plan.describe().splitlines()[0] == ("attention backend (measured now; one layer's call) -> reference "
                                               "(cpu_native slower on decode, 64 keys a sequence: its timing failed; "
                                               "prefill: its timing failed)")
    assert "RuntimeError('no kernel for this shape')" in caplog.text
    assert not list((tmp_path / "op_timings").glob("*.json"))     # nothing cached: timed again at the next start


@NEEDS_KERNELS
def test_the_real_figures_are_cached_and_shown_by_explain(moe_model, tmp_path, monkeypatch):
    first = explain_measuring(moe_model, tmp_path, monkeypatch)
    lines = [line for line in first.splitlines() if " us at " in line and ("keys" in line or "experts" in line
                                                                            or line.startswith("  prefill"))]
    assert [line.split(":")[0].strip() for line in lines] == ["decode, 512 keys a sequence", "prefill",
                                                              "routed experts"]
    assert "cpu_native" in lines[0] and "vs reference" in lines[0] and lines[0].endswith("at 1/32 sequences")
    assert lines[1].endswith("at 256 tokens") and lines[2].endswith("at 1/32/256 tokens")
    assert "attention backend (measured now" in first and "moe backend (measured now" in first
    assert "not timed against the reference" not in first
    second = explain_measuring(moe_model, tmp_path, monkeypatch)
    assert "attention backend (cached figures" in second and "moe backend (cached figures" in second
    assert [line for line in second.splitlines() if line in lines] == lines
    named = explain_measuring(moe_model, tmp_path, monkeypatch, "--attention", "cpu_native")
    assert "attention backend (" not in named and "moe backend (cached figures" in named
    assert "not timed against the reference (the backend has no measure_key, or was named, or FDPLUG_OP_TIMING=0): " \
           "attention=cpu_native" in named


def test_the_expert_formats_are_the_models_own(moe_model, tmp_path):
    assert expert_formats(ModelConfig.from_dir(moe_model)) == [ExpertFormat()]
    assert expert_formats(ModelConfig.from_dir(moe_model, "fp8")) == [ExpertFormat("fp8_block", (128, 128))]
    arch, types, extra = GGUF_MOE["qwen3moe"]      # layer 0: a Q4_K_M mix; layer 1: other types, an F32 stack
    gguf, _ = write_pair(tmp_path, arch, types=types, **extra)
    assert expert_formats(ModelConfig.from_dir(gguf)) == [
        ExpertFormat("gguf", qtypes=(("down", "Q6_K"), ("gate", "Q4_K"), ("up", "Q4_K"))),
        ExpertFormat("gguf", qtypes=(("down", "Q8_0"), ("gate", "Q4_1"), ("up", "F32")))]


@NEEDS_KERNELS
@pytest.mark.parametrize("fmt", [ExpertFormat(), ExpertFormat("fp8_block", (32, 32)),
                                 ExpertFormat("gguf", qtypes=(("down", "Q6_K"), ("gate", "Q4_K"), ("up", "Q8_0")))])
def test_the_timed_experts_are_ones_both_backends_compute_alike(moe_model, fmt):
    """The random experts load in either backend, and one routed call of the same tokens gives the
    same result in both (to float32 rounding): what is timed is the real work, not an error path.
    A budget of one expert's bytes still loads the top-k."""
    from fdplug.core.portable.moe import ReferenceMoE
    from fdplug.plugins.cpu.native_moe import NativeCpuMoE

    cfg = ModelConfig.from_dir(moe_model)
    if fmt.format == "gguf":           # K-quant rows are 256 wide
        cfg.hidden_size, cfg.moe = 256, dataclasses.replace(cfg.moe, intermediate_size=256)
    outs = [experts_call(backend, cfg, fmt, "float32", 1 << 30, np.random.default_rng(0))(32)().numpy()
            for backend in (NativeCpuMoE(threads=2), ReferenceMoE())]
    assert outs[0].shape == (32, cfg.hidden_size) and np.abs(outs[1]).max() > 0
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4 * np.abs(outs[1]).max())
    size = fmt.expert_bytes(cfg, 4)
    assert experts_call(ReferenceMoE(), cfg, fmt, "float32", size, np.random.default_rng(0))(3)().shape == \
        [3, cfg.hidden_size]
