"""A checkpoint's weight quantization, read from ``config.json``'s ``quantization_config``.

One format is executed today: FP8 block quantization as DeepSeek-V3 and the HF/vLLM FP8 block
checkpoints store it (``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}``, optionally ``"scale_fmt": "ue8m0"``). Each quantized linear
has ``weight`` (e4m3, ``[N, K]``) and ``weight_scale_inv`` (float32, one per ``block`` tile):
``W[i, j] = weight[i, j] * weight_scale_inv[i // bn, j // bk]``. Anything else is refused by name
rather than loaded as something it is not. A float checkpoint can be quantized to the same
format while it loads (`with_quantization`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fdplug.core.config import QUANTIZATIONS
from fdplug.errors import ConfigError, ModelLoadError, UnsupportedModelError

FP8_BLOCK = "fp8_block"      # the weight format name backends list in ``weight_formats``
_FIX = "fix the model's config.json (compare with the original checkpoint's)."


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """FP8 block quantization of a checkpoint's linear layers.

    ``not_converted`` are HF module names (or fragments of them) left in float:
    ``modules_to_not_convert`` / ``ignored_layers``, matched as transformers does (a fragment that
    occurs in the module's name). Embeddings, norms, routers and ``lm_head`` are never converted.
    """

    block: tuple[int, int] = (128, 128)
    scale_fmt: str = "float"          # "ue8m0": the scales are powers of two (Blackwell's format)
    not_converted: tuple[str, ...] = ()
    format: str = FP8_BLOCK
    online: bool = False              # a float checkpoint quantized by the loader (``quantization="fp8"``)

    def converts(self, module: str) -> bool:
        """Whether the linear layer ``module`` (e.g. ``model.layers.0.self_attn.q_proj``) is FP8."""
        return not any(fragment in module for fragment in self.not_converted)

    def describe(self) -> str:
        kept = f", {len(self.not_converted)} module pattern(s) kept in float" if self.not_converted else ""
        source = ", quantized from float at load" if self.online else ""
        return f"fp8 e4m3 weights, {self.block[0]}x{self.block[1]} blocks, {self.scale_fmt} scales{kept}{source}"


def with_quantization(quant: QuantConfig | None, quantization: str | None) -> QuantConfig | None:
    """The checkpoint's quantization, or, for a float checkpoint and ``quantization="fp8"``, FP8
    128x128 blocks computed at load with the same math as an FP8 checkpoint (`fdplug.plugin_api.fp8.block_quant`).
    An FP8 checkpoint is already quantized: asking for fp8 again changes nothing."""
    if quantization is None:
        return quant
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization {quantization!r} is not supported (only {', '.join(QUANTIZATIONS)}).",
                          fix="use quantization='fp8' (--quantization fp8), or leave it unset for the checkpoint's.")
    return quant or QuantConfig(online=True)


def parse_quant(raw: dict[str, Any]) -> QuantConfig | None:
    """The checkpoint's quantization (None: float weights); unsupported schemes are refused by name."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"config.json's quantization_config must be an object (got {qc!r}).", fix=_FIX)
    method = qc.get("quant_method")
    if method != "fp8":
        raise UnsupportedModelError(f"quantization {method!r} is not supported (only FP8 block quantization, "
                                    "quant_method 'fp8').", fix="use a float or FP8 block-quantized checkpoint.")
    fmt, activations = qc.get("fmt", "e4m3"), qc.get("activation_scheme", "dynamic")
    block = qc.get("weight_block_size")
    if fmt != "e4m3" or activations != "dynamic" or block is None:
        raise UnsupportedModelError(
            f"FP8 with fmt={fmt!r}, activation_scheme={activations!r}, weight_block_size={block!r} is not supported "
            "(only e4m3 weights with block scales and dynamic activations).",
            fix="use an FP8 block checkpoint (weight_block_size [128, 128], as DeepSeek-V3 and Qwen3-FP8 ship).")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ModelLoadError(f"weight_block_size must be two positive integers (got {block!r}).", fix=_FIX)
    scale_fmt = qc.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise UnsupportedModelError(f"FP8 scale_fmt {scale_fmt!r} is not supported (float or ue8m0).", fix=_FIX)
    kept = list(qc.get("modules_to_not_convert") or []) + list(qc.get("ignored_layers") or [])
    if not all(isinstance(k, str) and k for k in kept):
        raise ModelLoadError(f"modules_to_not_convert/ignored_layers must be module names (got {kept!r}).", fix=_FIX)
    return QuantConfig(block=(block[0], block[1]), scale_fmt=scale_fmt, not_converted=tuple(kept))


def fused_quant(quant: Any, prefix: str, names: tuple[str, ...]) -> Any:
    """The quantization of one fused projection made of the HF linears ``prefix + name``: ``quant``
    if all are converted, None if none is; a mix cannot be fused and is refused by name. The
    decoder (what to build) and the weight slots (what to read) both ask this, so they agree."""
    if quant is None:
        return None
    if not isinstance(quant, QuantConfig):   # a GGUF file's per-tensor block types (`gguf_weights.GgufQuant`)
        return quant.fused(prefix, names)
    converted = [quant.converts(prefix + name) for name in names]
    if all(converted):
        return quant
    if not any(converted):
        return None
    raise UnsupportedModelError(f"{', '.join(prefix + n for n in names)} are fused into one projection, but "
                                "modules_to_not_convert keeps only some of them in float.",
                                fix="quantize all of them or none (list all or none in modules_to_not_convert).")


def mlp_quant(quant: QuantConfig | None, prefix: str) -> tuple[QuantConfig | None, QuantConfig | None]:
    """(fused gate/up, down) quantization of the HF MLP at ``prefix`` (``model.layers.0.mlp.``)."""
    return fused_quant(quant, prefix, ("gate_proj", "up_proj")), fused_quant(quant, prefix, ("down_proj",))


def shared_expert_prefix(layer_prefix: str, gated: bool) -> str:
    """Where a MoE layer's shared experts live: Qwen2-MoE's gated ``shared_expert``, else ``shared_experts``."""
    return layer_prefix + ("mlp.shared_expert." if gated else "mlp.shared_experts.")
