"""Record what transformers makes of a config.json that leaves a key out: fdplug's config-default fixture.

Needs transformers only (its config classes import without torch); dev only, never a runtime or CI
dependency::

    python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install transformers
    /tmp/tfvenv/bin/python tools/make_config_defaults.py    # writes tests/fixtures/config_defaults.json

Why: a checkpoint means whatever transformers makes of it, and transformers' defaults differ per
architecture in ways no one guesses (ERNIE-4.5 dense defaults ``head_dim`` to 128, its MoE sibling
to ``hidden_size // num_attention_heads``; Qwen2 defaults ``num_key_value_heads`` to 32, not to the
number of heads). For each architecture fdplug supports, a full config.json sets every key fdplug
reads with a default to a value that is *not* that default; then each key is left out in turn, the
directory is loaded with ``AutoConfig.from_pretrained`` (the path a checkpoint takes) and the
quantities the model is built from are recorded the way each ``modeling_*.py`` derives them (e.g.
``head_dim = getattr(config, "head_dim", hidden_size // num_attention_heads)``). Not recorded:
``num_nextn_predict_layers`` (transformers 5's GLM-4.5 config defaults it to 1, 4.x has no default,
and no modeling file reads it: transformers drops GLM's MTP layers by name, fdplug skips them only
when declared) and the five shape keys every config.json has (fdplug requires them).

The fixture holds, per architecture, the full ``config`` and its ``facts``, and per left-out key
only the facts that change (``tests/test_config.py`` loads each through fdplug and compares).
Deterministic: rerun after a transformers upgrade and review the diff.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import transformers
from transformers import AutoConfig

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "config_defaults.json"

# Keys every config.json has (fdplug requires them): not left out. 64 heads: every architecture's
# default num_key_value_heads (2 to 32) divides them and none equals them; hidden // heads = 64.
_REQUIRED = {"vocab_size": 256, "hidden_size": 4096, "intermediate_size": 128, "num_hidden_layers": 6,
             "num_attention_heads": 64, "hidden_act": "silu"}

# Keys fdplug reads with a default, set to values no architecture defaults to. Booleans are set to
# the opposite of the architecture's default (found by loading the bare config first).
_ATTENTION = {"head_dim": 32, "num_key_value_heads": 1, "rope_theta": 20000.0, "partial_rotary_factor": 0.75,
              "rms_norm_eps": 3e-6, "max_position_embeddings": 4096, "tie_word_embeddings": None}
_QWEN_MOE = {"num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": None,
             "decoder_sparse_step": 2, "mlp_only_layers": [1]}


def _bias(qkv: str | bool, o: str | bool, mlp: str | bool, qk_norm: str | bool) -> Callable[[Any], dict]:
    """Which projections carry a bias and whether q/k are normed, as the modeling file builds them:
    a config attribute name, or a constant where the modeling file hard-codes it."""
    def read(c: Any) -> dict[str, bool]:
        def pick(rule: str | bool) -> bool:
            return rule if isinstance(rule, bool) else bool(getattr(c, rule))
        return {"qkv_bias": pick(qkv), "o_bias": pick(o), "mlp_bias": pick(mlp), "qk_norm": pick(qk_norm)}
    return read


def _qwen_moe(c: Any, shared: bool) -> dict[str, Any]:
    """modeling_qwen{2,3}_moe.py: layer i is MoE unless in mlp_only_layers, when (i+1) % step == 0."""
    layers = [i for i in range(c.num_hidden_layers) if i not in c.mlp_only_layers
              and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0]
    width = c.shared_expert_intermediate_size if shared else 0
    return {"num_experts": c.num_experts, "moe_intermediate_size": c.moe_intermediate_size,
            "top_k": c.num_experts_per_tok, "renormalize": bool(c.norm_topk_prob), "moe_layers": layers,
            "shared_intermediate_size": width, "shared_gate": width > 0}


def _ernie_moe(c: Any) -> dict[str, Any]:
    """modeling_ernie4_5_moe.py: every moe_layer_interval-th layer from start to end index."""
    layers = [i for i in range(c.num_hidden_layers) if (i + 1) % c.moe_layer_interval == 0
              and c.moe_layer_start_index <= i <= c.moe_layer_end_index]
    return {"num_experts": c.moe_num_experts, "moe_intermediate_size": c.moe_intermediate_size, "top_k": c.moe_k,
            "moe_layers": layers, "shared_intermediate_size": c.moe_intermediate_size * c.moe_num_shared_experts,
            "norm_floor": c.moe_norm_min}


def _ernie_vl_moe(c: Any) -> dict[str, Any]:
    """modeling_ernie4_5_vl_moe.py: layer i is MoE when mlp_layer_types[i] is "sparse" (absent: all
    but layer 0); text experts of moe_intermediate_size[0] (the shared ones too), as many vision
    experts of moe_intermediate_size[1]; ERNIE-4.5-MoE's routing (always renormalised, floored)."""
    text, vision = c.moe_intermediate_size
    return {"num_experts": c.moe_num_experts, "moe_intermediate_size": text, "top_k": c.moe_k, "renormalize": True,
            "moe_layers": [i for i, kind in enumerate(c.mlp_layer_types) if kind == "sparse"],
            "shared_intermediate_size": text * c.moe_num_shared_experts, "shared_gate": False,
            "norm_floor": c.moe_norm_min, "vision_experts": c.moe_num_experts, "vision_intermediate_size": vision}


def _glm_moe(c: Any) -> dict[str, Any]:
    """modeling_glm4_moe.py: MoE from first_k_dense_replace on; grouped routing, scaled."""
    return {"num_experts": c.n_routed_experts, "moe_intermediate_size": c.moe_intermediate_size,
            "top_k": c.num_experts_per_tok, "renormalize": bool(c.norm_topk_prob),
            "moe_layers": list(range(c.first_k_dense_replace, c.num_hidden_layers)),
            "shared_intermediate_size": c.moe_intermediate_size * c.n_shared_experts,
            "routed_scaling": float(c.routed_scaling_factor), "num_groups": c.n_group, "topk_groups": c.topk_group}


class Spec(NamedTuple):
    """One architecture: its model_type, the keys left out in turn with their full-config values (None:
    the opposite of the bare config's), biases, MoE facts, more of the config.json that is never left
    out (it overrides ``_REQUIRED``), the config the language model is built from, whether the
    language keys (``_REQUIRED``, ``fixed["text_config"]`` and ``keys`` but ``_OUTER``) are nested in
    ``text_config`` (the fixture lists those left out there as ``text_config_keys``), and further facts."""

    model_type: str
    keys: dict[str, Any]
    biases: Callable[[Any], dict]
    moe: Callable[[Any], dict] | None = None
    fixed: dict[str, Any] | None = None
    language: Callable[[Any], Any] = lambda c: c
    text_config: bool = False
    more: Callable[[Any], dict] | None = None


# Read from the outer config of a nested one: transformers 5 ties lm_head there.
_OUTER = ("tie_word_embeddings",)


# Qwen2.5-VL as Qwen/Qwen2.5-VL-*-Instruct's config.json has it: flat (4.x style), the language keys at
# the top, which Qwen2_5_VLConfig moves into its text_config; tie_word_embeddings stays on the outer
# config (where transformers 5 ties lm_head). Its text attention takes head_dim = hidden_size //
# heads and rotates all of it (a head_dim or partial_rotary_factor key would stay on the outer config,
# unread, and Hub checkpoints have neither: not left out). hidden 2048 / 64 heads: head_dim 32, so
# the mrope_section sums to 16 frequencies; token ids within the vocabulary.
_QWEN2_5_VL = {"hidden_size": 2048, "bos_token_id": 248, "eos_token_id": 249,
               "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
               "vision_config": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
                                 "out_hidden_size": 2048, "fullatt_block_indexes": [1], "tokens_per_second": 2},
               "image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252,
               "vision_end_token_id": 253}

# ERNIE-4.5-VL (MoE) as transformers 5 saves it (and as Ernie4_5_VLMoeConfig reads it): the language
# keys nested in text_config. A flat config.json (4.x style, model_type ernie4_5_vl_moe) reads the same
# (the outer config builds its text_config from them when it has none), but transformers never wrote
# one; Baidu's remote-code config.json (model_type ernie4_5_moe_vl) is not transformers'. lm_head is
# tied by the outer tie_word_embeddings (default true); text_config's own, which transformers saves as
# true when only the outer says false, ties nothing. Attention and RoPE take head_dim = getattr(config,
# "head_dim", hidden // heads), and mrope_section (default [22, 22, 20], 64 frequencies) must sum to
# head_dim / 2: no config.json leaving head_dim out or mrope_section out is valid unless hidden // heads
# is 128, so head_dim is not left out (8192 / 64 heads: 128) and rope_parameters (the mrope_section)
# is. moe_num_experts is one count for the text and the vision experts, moe_intermediate_size their
# [text, vision] widths; the sparse layers are mlp_layer_types' (absent: all but layer 0), never read from
# ERNIE-4.5-MoE's moe_layer_* keys (one is set to show it).
_ERNIE4_5_VL = {"image_start_token_id": 248, "image_end_token_id": 249, "image_token_id": 250,
                "video_start_token_id": 251, "video_end_token_id": 252, "video_token_id": 253,
                "vision_config": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
                                  "patch_size": 14, "spatial_merge_size": 2, "temporal_merge_size": 2},
                "text_config": {"hidden_size": 8192, "tie_word_embeddings": True, "moe_layer_start_index": 3}}

# fdplug architecture -> Spec (or a plain tuple of its first four fields)
SPECS: dict[str, tuple] = {
    "LlamaForCausalLM": ("llama", {**_ATTENTION, "attention_bias": None, "mlp_bias": None},
                         _bias("attention_bias", "attention_bias", "mlp_bias", False), None),
    "Qwen2ForCausalLM": ("qwen2", _ATTENTION, _bias(True, False, False, False), None),
    "Qwen3ForCausalLM": ("qwen3", {**_ATTENTION, "attention_bias": None},
                         _bias("attention_bias", "attention_bias", False, True), None),
    "Ernie4_5ForCausalLM": ("ernie4_5", {**_ATTENTION, "use_bias": None},
                            _bias("use_bias", "use_bias", "use_bias", False), None),
    "Qwen2MoeForCausalLM": ("qwen2_moe", {**_ATTENTION, "qkv_bias": None, **_QWEN_MOE,
                                          "shared_expert_intermediate_size": 80},
                            _bias("qkv_bias", False, False, False), lambda c: _qwen_moe(c, shared=True)),
    "Qwen3MoeForCausalLM": ("qwen3_moe", {**_ATTENTION, "attention_bias": None, **_QWEN_MOE},
                            _bias("attention_bias", "attention_bias", False, True),
                            lambda c: _qwen_moe(c, shared=False)),
    "Ernie4_5_MoeForCausalLM": ("ernie4_5_moe", {**_ATTENTION, "use_bias": None, "moe_num_experts": 6, "moe_k": 2,
                                                 "moe_intermediate_size": 48, "moe_num_shared_experts": 1,
                                                 "moe_layer_start_index": 2, "moe_layer_end_index": 4,
                                                 "moe_layer_interval": 2, "moe_norm_min": 1e-6},
                                _bias("use_bias", "use_bias", "use_bias", False), _ernie_moe),
    # n_group / topk_group: 2 / 1, so leaving either out still routes (topk_group <= n_group); 16
    # experts, so one group's 8 cover the default num_experts_per_tok (8).
    "Glm4MoeForCausalLM": ("glm4_moe", {**_ATTENTION, "attention_bias": None, "use_qk_norm": None,
                                        "n_routed_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                        "n_shared_experts": 2, "routed_scaling_factor": 2.5, "n_group": 2,
                                        "topk_group": 1, "first_k_dense_replace": 2, "norm_topk_prob": None},
                           _bias("attention_bias", False, False, "use_qk_norm"), _glm_moe),
    "Qwen2_5_VLForConditionalGeneration": Spec(
        "qwen2_5_vl", {k: v for k, v in _ATTENTION.items() if k not in ("head_dim", "partial_rotary_factor")},
        _bias(True, False, False, False), fixed=_QWEN2_5_VL, language=lambda c: c.text_config),
    "Ernie4_5_VLMoeForConditionalGeneration": Spec(
        "ernie4_5_vl_moe",
        {**{k: v for k, v in _ATTENTION.items() if k not in ("head_dim", "partial_rotary_factor")}, "use_bias": None,
         "rope_parameters": {"rope_type": "default", "mrope_section": [20, 20, 24]}, "moe_num_experts": 6, "moe_k": 2,
         "moe_intermediate_size": [48, 24], "moe_num_shared_experts": 1, "moe_norm_min": 1e-6,
         "mlp_layer_types": ["dense", "dense", "sparse", "dense", "sparse", "sparse"]},
        _bias("use_bias", "use_bias", "use_bias", False), _ernie_vl_moe, fixed=_ERNIE4_5_VL,
        language=lambda c: c.text_config, text_config=True,
        more=lambda t: {"mrope_section": t.rope_parameters.get("mrope_section", [22, 22, 20])}),
}


def _load(raw: dict[str, Any]) -> Any:
    """What ``from_pretrained`` makes of this config.json."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(raw))
        return AutoConfig.from_pretrained(tmp)


def facts(c: Any, spec: Spec) -> dict[str, Any]:
    """The quantities fdplug's ModelConfig holds, as transformers' modeling code reads them: from the
    language model's config, but tie_word_embeddings from the model's own (transformers 5 ties there)."""
    t = spec.language(c)
    rope = dict(getattr(t, "rope_parameters", None) or {})   # 5.x; 4.x keeps them as attributes
    out = {"head_dim": getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
           "num_kv_heads": t.num_key_value_heads,
           "rope_theta": float(rope.get("rope_theta", getattr(t, "rope_theta", None))),
           "partial_rotary": float(rope.get("partial_rotary_factor", getattr(t, "partial_rotary_factor", None)) or 1.0),
           "rms_norm_eps": t.rms_norm_eps, "max_positions": t.max_position_embeddings,
           "tie_word_embeddings": bool(c.tie_word_embeddings), **spec.biases(t)}
    return out | (spec.moe(t) if spec.moe else {}) | (spec.more(t) if spec.more else {})


def build(arch: str, spec: Spec) -> dict[str, Any]:
    """One architecture's entry: the full config.json, its facts, and what leaving each key out changes."""
    fixed = dict(spec.fixed or {})
    head = {"architectures": [arch], "model_type": spec.model_type}
    if spec.text_config:
        text = {**_REQUIRED, **fixed.pop("text_config", {})}
        full = {**head, **fixed}
        bare = _load({**full, "text_config": text})
    else:
        bare = _load({**_REQUIRED, **head, **fixed})
        full = {**_REQUIRED, **head, **fixed}
    nested = [key for key in spec.keys if spec.text_config and key not in _OUTER]
    for key, value in spec.keys.items():
        if key in nested:
            text[key] = value if value is not None else not bool(getattr(spec.language(bare), key))
        else:
            full[key] = value if value is not None else not bool(getattr(bare, key) if hasattr(bare, key)
                                                                 else getattr(spec.language(bare), key))
    if spec.text_config:
        full["text_config"] = text
    full_facts = facts(_load(full), spec)
    left_out = {}
    for key in spec.keys:
        got = facts(_load(_without(full, key, key in nested)), spec)
        left_out[key] = {name: value for name, value in got.items() if full_facts[name] != value}
    entry = {"config": full, "facts": full_facts, "left_out": left_out}
    return entry | ({"text_config_keys": nested} if nested else {})


def _without(raw: dict[str, Any], key: str, nested: bool) -> dict[str, Any]:
    """The config.json without ``key``: left out of its ``text_config`` when ``nested``."""
    if nested:
        return {**raw, "text_config": {k: v for k, v in raw["text_config"].items() if k != key}}
    return {k: v for k, v in raw.items() if k != key}


def main() -> None:
    out = {"generated_by": "tools/make_config_defaults.py", "transformers": transformers.__version__,
           "architectures": {arch: build(arch, Spec(*spec)) for arch, spec in SPECS.items()}}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT} (transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
