"""GGUF MoE files (llama.cpp's ``qwen2moe``, ``qwen3moe``): the greedy tokens and logprobs of the float
Hugging Face twin holding the dequantized weights, on each MoE backend that runs the ``gguf`` expert
format; the experts kept in their GGML blocks; refusals by name (files from `fdplug.testing.gguf_kit`).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("paddle")

from fdplug.core.model.checkpoint.config import ModelConfig
from fdplug.core.model.checkpoint.footprint import parameter_counts, weight_footprint
from fdplug.core.model.loader import load_model
from fdplug.core.portable.attention import ReferenceAttention
from fdplug.core.portable.moe import ReferenceMoE
from fdplug.errors import UnsupportedModelError, WeightMismatchError
from fdplug.plugin_api.gguf_formats import row_bytes
from fdplug.testing.gguf_kit import write_pair
from tests.test_gguf_models import _rewrite
from tests.test_model_parity import Steps

EXPERTS = "model.layers.{}.mlp.experts.{}_proj"
# A Q4_K_M file's mix (Q4_K gate/up, Q6_K down) in layer 0; other block types, and an F32 stack among
# quantized ones, in layer 1; the shared expert's projections in their own types.
CASES = {
    "qwen2moe": ("qwen2moe", {EXPERTS.format("*", "gate"): "Q4_K", EXPERTS.format("*", "up"): "Q4_K",
                              EXPERTS.format(0, "down"): "Q6_K", EXPERTS.format(1, "down"): "Q8_0",
                              "model.layers.*.mlp.shared_expert.down_proj": "Q5_K"}, {}),
    # converters before 2025 squeezed the shared expert's gate to [H] (F32); newer ones keep [1, H]
    "qwen2moe-squeezed-gate": ("qwen2moe", {EXPERTS.format("*", "gate"): "Q4_1", EXPERTS.format("*", "up"): "Q8_0",
                                            EXPERTS.format("*", "down"): "Q4_0"}, {"squeezed_gate": True}),
    "qwen3moe": ("qwen3moe", {EXPERTS.format(0, "gate"): "Q4_K", EXPERTS.format(0, "up"): "Q4_K",
                              EXPERTS.format(0, "down"): "Q6_K", EXPERTS.format(1, "gate"): "Q4_1",
                              EXPERTS.format(1, "up"): "F32", EXPERTS.format(1, "down"): "Q8_0"}, {"experts": 8}),
}


def _backend(name: str):
    if name == "reference":
        return ReferenceMoE()
    from fdplug.plugins.cpu import kernels

    if kernels.unavailable_reason():
        pytest.skip(f"the cpu kernels do not build here: {kernels.unavailable_reason()}")
    from fdplug.plugins.cpu.native_moe import NativeCpuMoE

    return NativeCpuMoE(threads=2)


def greedy(steps: Steps, prompt: list[int], n: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """``n`` greedy tokens after ``prompt``, one decode step each: (tokens, their logprobs, the
    logits of every position)."""
    logits = [steps.step({0: prompt})[0]]
    tokens = []
    for _ in range(n):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(steps.step({0: [tokens[-1]]})[0])
    rows = np.concatenate([logits[0][-1:], *logits[1:-1]]).astype(np.float64)   # the rows each token came from
    top = rows.max(1)
    logprobs = rows[np.arange(n), tokens] - top - np.log(np.exp(rows - top[:, None]).sum(1))
    return tokens, logprobs, np.concatenate(logits)


PROMPT = [5, 17, 200, 3, 99, 250, 1, 42, 7, 123]


@pytest.mark.parametrize("backend", ["reference", "cpu_native"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_gguf_moe_model_computes_its_float_twin(tmp_path, case, backend):
    """Prefill then decode steps: the same greedy tokens, and logits equal to float32 rounding (the
    dense GGUF tests' tolerance), as the float checkpoint with the experts dequantized by ggml's
    reference and stored one by one, run by the float reference backend."""
    arch, types, extra = CASES[case]
    gguf, floats = write_pair(tmp_path, arch, types=types, **extra)
    quantized = Steps("gguf", 1, max_len=32, model_dir=gguf, moe_backend=_backend(backend))
    got_tokens, got_logprobs, got = greedy(quantized, PROMPT, 8)
    want_tokens, want_logprobs, want = greedy(Steps("float", 1, max_len=32, model_dir=floats), PROMPT, 8)
    assert got_tokens == want_tokens
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(got_logprobs, want_logprobs, rtol=0, atol=1e-5)


def test_the_routing_is_llama_cpps(tmp_path):
    """llama.cpp renormalises the top-k weights for qwen3moe and not for qwen2moe, whatever the file
    says; and the rule is felt: the twin with the other rule computes other logits."""
    for arch in ("qwen2moe", "qwen3moe"):
        gguf, floats = write_pair(tmp_path, arch, types={})     # tiny-<arch>.gguf, tiny-<arch>-float
        cfg = ModelConfig.from_dir(gguf)
        assert cfg.moe.routing.renormalize == (arch == "qwen3moe") and cfg.moe.routing.top_k == 2
        assert cfg.moe.num_experts == 4 and cfg.moe.intermediate_size == 256 and cfg.moe.layers == (0, 1)
        assert cfg.moe.shared_intermediate_size == (512 if arch == "qwen2moe" else 0)
        assert cfg.traits().moe_weight_format == "gguf" and cfg.traits().linear_weight_format == "gguf"
        config = json.loads((floats / "config.json").read_text())
        config["norm_topk_prob"] = not config["norm_topk_prob"]
        (floats / "config.json").write_text(json.dumps(config))
        got = Steps("gguf", 1, max_len=32, model_dir=gguf).step({0: PROMPT})[0]
        other = Steps("flipped", 1, max_len=32, model_dir=floats).step({0: PROMPT})[0]
        assert np.abs(got - other).max() > 1e-2 * np.abs(got).max(), arch


def test_the_experts_stay_in_their_blocks(tmp_path):
    """The backend holds each layer's experts as the file's bytes (uint8, one row size per type), so
    the loaded model takes about the file's size, a fraction of the float32 model's; the footprint
    planned from the config says the same before loading."""
    types = {EXPERTS.format("*", "gate"): "Q4_K", EXPERTS.format("*", "up"): "Q4_K",
             EXPERTS.format(0, "down"): "Q6_K", EXPERTS.format(1, "down"): "Q4_1"}
    gguf, _ = write_pair(tmp_path, "qwen3moe", types=types, experts=8)
    model = Steps("gguf", 1, model_dir=gguf).model
    held, experts = sum(int(p.numel()) * p.element_size() for p in model.parameters()), 0
    for i, down in enumerate(("Q6_K", "Q4_1")):
        layer = model.layers[i].mlp.experts
        assert layer.qtypes == {"gate": "Q4_K", "up": "Q4_K", "down": down}
        for t, shape in ((layer.gate, [8, 256, row_bytes("Q4_K", 256)]), (layer.up, [8, 256, row_bytes("Q4_K", 256)]),
                         (layer.down, [8, 256, row_bytes(down, 256)])):
            assert str(t.dtype) == "paddle.uint8" and t.shape == shape
            experts += int(t.numel())
    held += experts
    size = gguf.stat().st_size
    cfg = ModelConfig.from_dir(gguf)
    assert 0.9 * size < held < 1.02 * size
    assert held < parameter_counts(cfg)[0] * 4 / 5     # float32 would be 5-7x the blocks
    footprint = weight_footprint(cfg, "float32")
    assert footprint.expert_bytes == experts and abs(footprint.total_bytes - held) < 0.02 * held


def test_an_expert_type_the_decoder_lacks_is_refused_by_name(tmp_path):
    """Read from the file's index when the config is: nothing is built or loaded."""
    gguf, _ = write_pair(tmp_path, "qwen3moe", types={EXPERTS.format(1, "down"): "Q3_K"})
    with pytest.raises(UnsupportedModelError, match=r"'blk\.1\.ffn_down_exps\.weight': GGML tensor type 'Q3_K'"):
        ModelConfig.from_dir(gguf)
    with pytest.raises(UnsupportedModelError, match="ffn_down_exps"):
        load_model(gguf, ReferenceAttention(), show_progress=False)


def test_expert_tensors_that_do_not_fit_the_metadata_are_refused_by_name(tmp_path):
    src, _ = write_pair(tmp_path, "qwen2moe", types={})
    narrow = _rewrite(src, tmp_path / "narrow.gguf", metadata={"qwen2moe.expert_feed_forward_length": 128})
    with pytest.raises(WeightMismatchError, match="ffn_gate_exps"):
        Steps("narrow", 1, model_dir=narrow)
    missing = _rewrite(src, tmp_path / "missing.gguf", drop="blk.1.ffn_up_exps.weight")
    with pytest.raises(WeightMismatchError, match="ffn_up_exps"):
        Steps("missing", 1, model_dir=missing)


@pytest.mark.parametrize("backend", ["reference", "cpu_native"])
def test_the_engine_serves_a_gguf_moe_file(tmp_path, backend):
    """Through `fdplug.LLM` (selection, runner, sampler): the twin's greedy tokens and logprobs (the
    dense GGUF linears in float32 math where bf16 or q8 math would be selected: cpu_native_gguf_linear)."""
    from fdplug.core.frontend.llm import LLM
    from fdplug.core.plugin_loading.selection import select_components
    from fdplug.plugin_api.sampling_params import SamplingParams

    _backend(backend)   # skips where cpu_native cannot run
    arch, types, extra = CASES["qwen2moe"]
    gguf, floats = write_pair(tmp_path, arch, types=types, tokenizer=True, **extra)
    chosen = select_components("cpu").ops["gguf_linear"]
    exact = {"gguf_linear": "cpu_native_gguf_linear"} if chosen.bf16_inputs or chosen.q8_inputs else {}
    llm = LLM(str(gguf), max_model_len=64, num_kv_blocks=32, moe_backend=backend, op_kernels=exact)
    assert llm.engine.selection.moe.name == backend
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    tokens, logprobs, _ = greedy(Steps("float", 1, max_len=32, model_dir=floats), PROMPT, 8)
    assert list(out.token_ids) == tokens
    np.testing.assert_allclose([step[t].logprob for step, t in zip(out.logprobs, tokens)], logprobs, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "cpu_native"])
def test_backends_refuse_gguf_experts_that_are_not_what_qtypes_say(backend):
    """`ExpertWeights.check_gguf` at load: rows of another type's size, a missing type, a type the
    block decoder lacks (by name)."""
    import paddle

    from fdplug.plugin_api.moe import ExpertWeights

    moe = _backend(backend)

    def weights(**qtypes):
        shapes = {"gate": [2, 64, row_bytes("Q8_0", 256)], "up": [2, 64, row_bytes("Q8_0", 256)],
                  "down": [2, 256, row_bytes("Q8_0", 64)]}
        tensors = {name: paddle.zeros(shape, dtype="uint8") for name, shape in shapes.items()}
        return ExpertWeights(**tensors, format="gguf", qtypes={"gate": "Q8_0", "up": "Q8_0", "down": "Q8_0", **qtypes})

    layer = moe.load_weights(weights())
    x = paddle.ones([3, 256])
    out = moe.forward(x, paddle.full([3, 1], 0.5), paddle.to_tensor([[0], [1], [1]], dtype="int64"), layer)
    assert out.shape == [3, 256] and float(out.abs().max()) == 0.0     # zero scales: zero weights
    with pytest.raises(ValueError, match=r"down must be uint8 \[E, rows, row_bytes\(Q4_0, 64\)\]"):
        moe.load_weights(weights(down="Q4_0"))
    w = weights()
    del w.qtypes["up"]
    with pytest.raises(ValueError, match="up must be"):
        moe.load_weights(w)
    with pytest.raises(UnsupportedModelError, match="Q2_K"):
        moe.load_weights(weights(gate="Q2_K"))
