"""Which architectures fdplug runs, and how each reads its ``config.json``.

Each default is the one its transformers config class (or, for a key the class lacks, its modeling
file) uses when the key is absent: a checkpoint means whatever transformers makes of it.
``tests/fixtures/config_defaults.json`` (``tools/make_config_defaults.py``) checks every one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fdplug.errors import ModelLoadError, UnsupportedModelError

_Rule = str | bool | tuple[str, bool]


@dataclass(frozen=True, slots=True)
class Arch:
    """How one supported architecture reads its config.json: each default is the one its transformers
    config class (or, for a key the class lacks, its modeling file) uses when the key is absent."""

    default_theta: float = 10000.0
    default_head_dim: int | None = None      # None: hidden_size // num_heads
    default_kv_heads: int | None = None      # None: num_attention_heads
    default_tie: bool = False
    default_eps: float = 1e-6
    default_max_positions: int = 2048
    qkv_bias: _Rule = "attention_bias"       # fixed, a config key (absent: False), or (key, default)
    o_bias: _Rule = "attention_bias"
    mlp_bias: _Rule = False
    qk_norm: _Rule = False
    interleaved_rope: bool = False
    default_partial_rotary: float = 1.0
    mrope_interleaved_hw: bool = False       # ERNIE-4.5-VL's multimodal RoPE (`rope.RopeConfig.mrope_axes`)
    default_mrope: tuple[int, ...] = ()      # its mrope_section when config.json has none
    text_config_ties: bool = False           # a text_config's tie_word_embeddings true ties too (`language_side`)


ARCHITECTURES: dict[str, Arch] = {
    "LlamaForCausalLM": Arch(mlp_bias="mlp_bias"),
    "Qwen2ForCausalLM": Arch(default_kv_heads=32, qkv_bias=True, o_bias=False, default_max_positions=32768),
    "Qwen3ForCausalLM": Arch(default_head_dim=128, default_kv_heads=32, qk_norm=True, default_max_positions=32768),
    "Ernie4_5ForCausalLM": Arch(default_theta=500000.0, default_head_dim=128, default_kv_heads=2, default_tie=True,
                                 default_eps=1e-5, default_max_positions=131072, qkv_bias="use_bias",
                                 o_bias="use_bias", mlp_bias="use_bias", interleaved_rope=True),
}
# The MoE architectures: attention as their dense siblings', the MLPs per `moe_config`; but their
# config classes have no head_dim (hidden_size // num_heads) and other num_key_value_heads defaults.
ARCHITECTURES |= {
    "Qwen2MoeForCausalLM": replace(ARCHITECTURES["Qwen2ForCausalLM"], default_kv_heads=16,
                                   qkv_bias=("qkv_bias", True)),
    "Qwen3MoeForCausalLM": replace(ARCHITECTURES["Qwen3ForCausalLM"], default_head_dim=None, default_kv_heads=4),
    "Ernie4_5_MoeForCausalLM": replace(ARCHITECTURES["Ernie4_5ForCausalLM"], default_head_dim=None,
                                       default_kv_heads=4),
    # GLM-4.5/4.6 (transformers' Glm4MoeForCausalLM): NeoX RoPE on the first half of each head.
    "Glm4MoeForCausalLM": Arch(default_kv_heads=8, default_eps=1e-5, default_max_positions=131072, o_bias=False,
                                qk_norm="use_qk_norm", default_partial_rotary=0.5),
}
# Vision-language models: the language side is the dense decoder above with multimodal RoPE
# (`rope.RopeConfig.mrope_section`); the vision tower is `fdplug.core.vision`.
ARCHITECTURES |= {
    # Qwen2_5_VLTextConfig: rope_theta 1e6 (its default_theta), 8 kv heads, eps 1e-5; its attention
    # takes head_dim = hidden_size // heads (Hub configs have no head_dim). Qwen2_5_VLConfig forwards a
    # text_config's tie_word_embeddings true to the outer config (pre-v5 saves kept it there).
    "Qwen2_5_VLForConditionalGeneration": replace(ARCHITECTURES["Qwen2ForCausalLM"], default_theta=1000000.0,
                                                  default_kv_heads=8, default_eps=1e-5, text_config_ties=True),
    # ERNIE-4.5-VL: ERNIE-4.5-MoE's attention with 3-D RoPE, and text and vision experts (`moe_config`)
    "Ernie4_5_VLMoeForConditionalGeneration": replace(ARCHITECTURES["Ernie4_5_MoeForCausalLM"], default_kv_heads=4,
                                                      mrope_interleaved_hw=True, default_mrope=(22, 22, 20)),
}

# Names the same architecture goes by (Baidu's remote-code configs say Ernie4_5_ForCausalLM).
ALIASES = {"Ernie4_5_ForCausalLM": "Ernie4_5ForCausalLM",
           "Ernie4_5_VL_MoeForConditionalGeneration": "Ernie4_5_VLMoeForConditionalGeneration"}


def pick_architecture(raw: dict[str, Any]) -> tuple[str, Arch]:
    names = raw.get("architectures") or []
    for name in names:
        name = ALIASES.get(name, name)
        if name in ARCHITECTURES:
            return name, ARCHITECTURES[name]
    shown = ", ".join(map(str, names)) or f"none (model_type={raw.get('model_type')!r})"
    raise UnsupportedModelError(f"model architecture {shown} is not supported; supported: "
                                f"{', '.join(ARCHITECTURES)}.",
                                fix="use a checkpoint of a supported architecture, or add one under "
                                    "fdplug/core/model/.")


def check_supported(raw: dict[str, Any], arch: str) -> None:
    """Refuse features the decoder does not implement rather than compute something else."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{arch} with hidden_act={act!r} is not supported (only 'silu').",
                                    fix="use a checkpoint with a SwiGLU ('silu') MLP.")
    if float(raw.get("compression_ratio") or 1.0) != 1.0:
        raise UnsupportedModelError(f"{arch} with compression_ratio={raw['compression_ratio']} (compressed RoPE "
                                    "positions) is not supported.", fix="use a checkpoint with compression_ratio 1.")
    if _sliding_layers(raw):
        raise UnsupportedModelError(f"{arch} with sliding-window attention is not supported.",
                                    fix="set use_sliding_window to false in config.json if the model allows it.")


def _sliding_layers(raw: dict[str, Any]) -> bool:
    layer_types = raw.get("layer_types")
    if layer_types:
        return any(t == "sliding_attention" for t in layer_types)
    if not raw.get("use_sliding_window") or raw.get("sliding_window") is None:
        return False
    return int(raw.get("num_hidden_layers", 0)) > int(raw.get("max_window_layers", 28))


def kv_heads(raw: dict[str, Any], arch_name: str, arch: Arch, heads: int) -> int:
    """``num_key_value_heads``; absent, the architecture's fixed default (None: ``heads``), which
    may not divide ``heads``: say so, since "not a multiple" of a number not in the file puzzles."""
    value = raw.get("num_key_value_heads", arch.default_kv_heads)
    if "num_key_value_heads" not in raw and value is not None and heads % value:
        raise ModelLoadError(f"config.json has no 'num_key_value_heads', and {arch_name}'s default (transformers') "
                             f"is {value}, which does not divide num_attention_heads={heads}.",
                             fix="add num_key_value_heads to config.json (k_proj's output rows / head_dim).")
    return int(value or heads)


def flag(raw: dict[str, Any], rule: _Rule) -> bool:
    if isinstance(rule, bool):
        return rule
    key, default = rule if isinstance(rule, tuple) else (rule, False)
    value = raw.get(key)
    return default if value is None else bool(value)
