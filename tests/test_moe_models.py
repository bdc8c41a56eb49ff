"""MoE models through the engine: config rules, both expert layouts, memory honesty, and greedy tokens
equal to a naive full recompute under batching, chunking and preemption, for every MoE backend.

Parity with transformers itself is in `test_model_parity.py` / `test_moe_golden.py` (golden fixtures).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from fdplug.core.frontend.llm import LLM  # noqa: E402
from fdplug.core.model.checkpoint.config import ModelConfig  # noqa: E402
from fdplug.core.model.checkpoint.footprint import parameter_counts  # noqa: E402
from fdplug.errors import ConfigError, ModelLoadError  # noqa: E402
from fdplug.plugin_api.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import write_test_model  # noqa: E402
from tests.reference import naive_greedy  # noqa: E402
from tests.test_moe_golden import servable  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
QWEN2_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 3, "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
             "mlp_only_layers": [0]}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 3, "num_experts": 16,
             "num_experts_per_tok": 4, "moe_intermediate_size": 24, "norm_topk_prob": True, "decoder_sparse_step": 1}
MOE_BACKENDS = ["reference", "cpu_native"]
MODELS = ["qwen2_moe", "qwen3_moe", "ernie4_5_moe", "glm4_moe"]   # the last two: transformers' golden fixtures


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {"qwen2_moe": write_test_model(root / "qwen2_moe", **QWEN2_MOE),
            "qwen3_moe": write_test_model(root / "qwen3_moe", **QWEN3_MOE),
            "ernie4_5_moe": Path(servable("ernie4_5_moe", root)),
            "glm4_moe": Path(servable("glm4_moe", root))}


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)      # ids below the fixtures' vocabulary of 256
    shared = rng.integers(0, 256, size=40).tolist()
    return [rng.integers(0, 256, size=n).tolist() for n in (61, 1, 17, 33)] + [shared + [1, 2], shared + [3]]


@pytest.fixture(scope="module")
def references(moe_dirs):
    out = {}
    for name, path in moe_dirs.items():
        llm = LLM(str(path), num_kv_blocks=64, max_model_len=128, moe_backend="reference")
        out[name] = [naive_greedy(llm, p, GREEDY.max_tokens) for p in _prompts()]
    return out


def _generate(path, **engine_args):
    llm = LLM(str(path), max_model_len=128, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", MOE_BACKENDS)
@pytest.mark.parametrize("model", MODELS)
def test_batched_and_chunked_equal_the_naive_recompute(moe_dirs, references, model, backend):
    llm, got = _generate(moe_dirs[model], num_kv_blocks=64, moe_backend=backend)
    assert llm.engine.selection.moe.name == backend
    assert got == references[model]
    _, chunked = _generate(moe_dirs[model], num_kv_blocks=64, moe_backend=backend, max_num_seqs=3,
                           max_num_batched_tokens=8)
    assert chunked == references[model]


@pytest.mark.parametrize("backend", MOE_BACKENDS)
@pytest.mark.parametrize("model", MODELS)
def test_preemption_does_not_change_a_token(moe_dirs, references, model, backend):
    llm, got = _generate(moe_dirs[model], num_kv_blocks=10, max_num_seqs=6, enable_prefix_caching=False,
                         moe_backend=backend)
    assert llm.engine.stats().num_preemptions > 0
    assert got == references[model]


def test_the_experts_change_the_output(moe_dirs, references):
    """A loader that dropped the experts (or a router that always picked the same ones) would still
    generate something: scaling one expert must change the greedy tokens."""
    llm = LLM(str(moe_dirs["qwen3_moe"]), num_kv_blocks=64, max_model_len=128, moe_backend="reference")
    block = llm.engine.runner.model.layers[1].mlp
    block.experts.down[:] = block.experts.down * 0.0
    assert [naive_greedy(llm, p, GREEDY.max_tokens) for p in _prompts()] != references["qwen3_moe"]


# --------------------------------------------------------------------------------------------------
# expert layouts on disk
# --------------------------------------------------------------------------------------------------


def write_fused_experts(src: Path, fused: Path) -> Path:
    """``src`` with its per-expert weights stored in the fused layout, as float32."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    fused.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            (fused / f.name).write_bytes(f.read_bytes())
    with safe_open(str(src / "model.safetensors"), framework="paddle") as f:
        tensors = {name: f.get_tensor(name).astype("float32").numpy() for name in f.keys()}
    cfg = ModelConfig.from_dir(src)
    for i in cfg.moe.layers:
        p = f"model.layers.{i}.mlp.experts."
        gate_up = [np.concatenate([tensors.pop(f"{p}{x}.gate_proj.weight"), tensors.pop(f"{p}{x}.up_proj.weight")])
                   for x in range(cfg.moe.num_experts)]
        tensors[p + "gate_up_proj"] = np.stack(gate_up)
        tensors[p + "down_proj"] = np.stack([tensors.pop(f"{p}{x}.down_proj.weight")
                                             for x in range(cfg.moe.num_experts)])
    assert not any(".experts.0." in name for name in tensors)
    save_file(tensors, str(fused / "model.safetensors"), metadata={"format": "pt"})
    return fused


@pytest.mark.parametrize("model", MODELS)
def test_fused_expert_layout_loads_to_the_same_model(moe_dirs, references, model, tmp_path):
    """``experts.gate_up_proj [E, 2I, H]`` (gate rows first) and ``experts.down_proj [E, H, I]``: the
    same greedy tokens as the per-expert keys (float32 copies: bf16 -> fp32 is exact)."""
    src = moe_dirs[model]
    fused = write_fused_experts(src, tmp_path / "fused")
    if model == "qwen3_moe":
        config = json.loads((fused / "config.json").read_text())
        config["num_local_experts"] = config.pop("num_experts")       # transformers 5's key
        (fused / "config.json").write_text(json.dumps(config))
    _, got = _generate(fused, num_kv_blocks=64, moe_backend="cpu_native")
    assert got == references[model]


# --------------------------------------------------------------------------------------------------
# config rules
# --------------------------------------------------------------------------------------------------


def _qwen3(**changes) -> dict:
    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    return base | changes


def _ernie(**changes) -> dict:
    base = {"architectures": ["Ernie4_5_MoeForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 2,
            "head_dim": 8, "moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 8}
    return base | changes


def _glm(**changes) -> dict:
    base = {"architectures": ["Glm4MoeForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "n_group": 4, "topk_group": 2}
    return base | changes


@pytest.mark.parametrize("raw, layers", [
    (_glm(), (1, 2, 3, 4, 5)),
    (_glm(first_k_dense_replace=3), (3, 4, 5)),
    (_qwen3(), (0, 1, 2, 3, 4, 5)),
    (_qwen3(decoder_sparse_step=2), (1, 3, 5)),
    (_qwen3(decoder_sparse_step=2, mlp_only_layers=[3]), (1, 5)),
    (_qwen3(num_experts=None, num_local_experts=4), (0, 1, 2, 3, 4, 5)),
    (_ernie(), (1, 2, 3, 4, 5)),
    (_ernie(moe_layer_start_index=2, moe_layer_end_index=4), (2, 3, 4)),
    (_ernie(moe_layer_interval=2), (1, 3, 5)),
])
def test_which_layers_are_moe(raw, layers):
    assert ModelConfig.from_dict(raw).moe.layers == layers


def test_ernie_routing_and_shared_experts_follow_the_config():
    moe = ModelConfig.from_dict(_ernie(moe_num_shared_experts=3, moe_norm_min=1e-6)).moe
    r = moe.routing
    assert (r.scoring, r.bias, r.renormalize, r.norm_floor, r.router_dtype) == ("softmax", True, True, 1e-6, "float32")
    assert moe.shared_intermediate_size == 24 and not moe.shared_gate


def test_glm_routing_rotary_and_shared_experts_follow_the_config():
    cfg = ModelConfig.from_dict(_glm(routed_scaling_factor=2.5, n_shared_experts=2, use_qk_norm=True))
    r = cfg.moe.routing
    assert (r.scoring, r.bias, r.num_groups, r.topk_groups, r.renormalize, r.scaling, r.router_dtype) == \
        ("sigmoid", True, 4, 2, True, 2.5, "float32")
    assert cfg.moe.shared_intermediate_size == 16 and not cfg.moe.shared_gate
    assert cfg.qk_norm and cfg.rope.rotary_dim(cfg.head_dim) == 4      # transformers' default: half the head
    assert ModelConfig.from_dict(_glm(partial_rotary_factor=1.0)).rope.rotary_dim(8) == 8
    assert not ModelConfig.from_dict(_glm()).qk_norm


def test_a_multi_token_prediction_layer_is_ignored_only_when_declared(moe_dirs, tmp_path):
    """GLM-4.5 checkpoints store their MTP layer as ``model.layers.{num_hidden_layers}`` (here in a shard of its
    own)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    src, model = moe_dirs["glm4_moe"], tmp_path / "mtp"
    model.mkdir()
    for f in src.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    save_file({"model.layers.3.eh_proj.weight": np.zeros((64, 128), np.float32)},
              str(model / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    with safe_open(str(src / "model.safetensors"), framework="numpy") as f:
        weight_map = dict.fromkeys(f.keys(), "model-00001-of-00002.safetensors")
    weight_map["model.layers.3.eh_proj.weight"] = "model-00002-of-00002.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match="model.layers.3.eh_proj.weight"):
        LLM(str(model), num_kv_blocks=16, max_model_len=64)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    ids = [_prompts()[2]]
    want = LLM(str(src), num_kv_blocks=16, max_model_len=64).generate([{"prompt_token_ids": p} for p in ids],
                                                                      GREEDY, use_tqdm=False)
    got = LLM(str(model), num_kv_blocks=16, max_model_len=64).generate([{"prompt_token_ids": p} for p in ids],
                                                                       GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_a_moe_architecture_with_no_moe_layer_is_dense():
    assert ModelConfig.from_dict(_qwen3(mlp_only_layers=list(range(6)))).moe is None
    assert ModelConfig.from_dict(_qwen3(num_experts=0)).moe is None


@pytest.mark.parametrize("change, words", [
    ({"num_experts_per_tok": 9}, "top_k=9"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({"num_experts": -1}, "num_experts"),
])
def test_inconsistent_moe_configs_are_refused_by_name(change, words):
    with pytest.raises(ModelLoadError, match=words):
        ModelConfig.from_dict(_qwen3(**change))


# --------------------------------------------------------------------------------------------------
# memory honesty
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["qwen2_moe", "qwen3_moe"])
def test_footprint_counts_every_parameter_and_the_experts(moe_dirs, model):
    from safetensors import safe_open

    cfg = ModelConfig.from_dir(moe_dirs[model])
    with safe_open(str(moe_dirs[model] / "model.safetensors"), framework="numpy") as f:
        on_disk = {name: int(np.prod(f.get_slice(name).get_shape())) for name in f.keys()}
    total, experts = parameter_counts(cfg)
    assert experts == sum(n for name, n in on_disk.items() if ".experts." in name)
    llm = LLM(str(moe_dirs[model]), num_kv_blocks=64, max_model_len=256)
    params = sum(int(np.prod(p.shape)) for p in llm.engine.runner.model.parameters())   # experts not among them
    assert total == params + experts
    assert llm.engine.runner.model_bytes == 4 * total      # float32, the experts counted though not parameters
    if not cfg.qk_norm:    # Qwen3 expands its per-head q/k norm weights to one row per head
        assert total == sum(on_disk.values())


def test_experts_that_do_not_fit_are_refused_before_loading(moe_dirs, monkeypatch):
    from fdplug.core.model import loader
    from fdplug.plugins.cpu import device

    monkeypatch.setattr(device, "free_memory", lambda index=0: 100_000)
    monkeypatch.setattr(loader, "load_weights", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ConfigError) as err:
        LLM(str(moe_dirs["qwen2_moe"]), num_kv_blocks=64, max_model_len=256)
    text = str(err.value)
    assert "routed experts take" in text and "2 MoE layers x 8 experts" in text and "97.7 KiB" not in text
    assert "free on device 'cpu'" in text
