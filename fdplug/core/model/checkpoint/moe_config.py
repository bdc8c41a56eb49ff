"""Which layers of a checkpoint are mixture-of-experts, and how they route: read from config.json.

Each MoE architecture names the same few facts differently; the parsers below turn them into one
`MoEConfig` (the routing itself is `fdplug.plugin_api.moe.Routing`). Defaults for keys a
config.json leaves out are transformers' own, as everywhere in `fdplug.core.model.checkpoint.config`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fdplug.errors import ModelLoadError
from fdplug.plugin_api.moe import Routing


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """The routed experts of a model: how many, how wide, which layers, and how tokens pick them.

    ``shared_intermediate_size`` is the width of the shared expert MLP every token also goes
    through (0: none); ``shared_gate``: its output is scaled by ``sigmoid(x @ shared_expert_gate)``
    (Qwen2-MoE). ``layers`` lists the decoder layers whose MLP is the MoE; the others are dense.
    """

    num_experts: int
    intermediate_size: int
    routing: Routing
    layers: tuple[int, ...]
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    vision: MoEConfig | None = None
    """Modality experts (ERNIE-4.5-VL): the experts, width and routing of the vision tokens, which
    never reach the experts above (the text tokens'); the shared experts serve both."""

    def expert_parameters(self, hidden_size: int) -> int:
        """Parameters of the routed experts in all MoE layers (gate, up and down of each expert)."""
        own = len(self.layers) * self.num_experts * 3 * self.intermediate_size * hidden_size
        return own + (self.vision.expert_parameters(hidden_size) if self.vision is not None else 0)


def _int(raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelLoadError(f"config.json's {key!r} must be a non-negative integer (got {value!r}).",
                             fix="fix the model's config.json (compare with the original checkpoint's).")
    return value


def _qwen_moe(raw: dict[str, Any], num_layers: int, *, experts: int, top_k: int, width: int,
              shared: int) -> MoEConfig | None:
    """Qwen2-MoE and Qwen3-MoE: layer i is MoE unless listed in ``mlp_only_layers``, when
    ``(i + 1) % decoder_sparse_step == 0``. Checkpoints say ``num_experts``; transformers 5 writes
    ``num_local_experts``."""
    num_experts = _int(raw, "num_experts", _int(raw, "num_local_experts", experts))
    step = max(_int(raw, "decoder_sparse_step", 1), 1)
    dense = set(raw.get("mlp_only_layers") or [])
    layers = tuple(i for i in range(num_layers) if num_experts > 0 and i not in dense and (i + 1) % step == 0)
    if not layers:
        return None
    routing = Routing(_int(raw, "num_experts_per_tok", top_k), renormalize=bool(raw.get("norm_topk_prob", False)))
    shared_width = _int(raw, "shared_expert_intermediate_size", shared)
    return MoEConfig(num_experts, _int(raw, "moe_intermediate_size", width), routing, layers,
                     shared_intermediate_size=shared_width, shared_gate=shared_width > 0)


def _qwen2_moe(raw: dict[str, Any], num_layers: int) -> MoEConfig | None:
    return _qwen_moe(raw, num_layers, experts=60, top_k=4, width=1408, shared=5632)


def _qwen3_moe(raw: dict[str, Any], num_layers: int) -> MoEConfig | None:
    return _qwen_moe({**raw, "shared_expert_intermediate_size": 0}, num_layers, experts=128, top_k=8, width=768,
                     shared=0)


def _ernie4_5_moe(raw: dict[str, Any], num_layers: int) -> MoEConfig | None:
    """ERNIE-4.5-MoE: layers ``moe_layer_start_index..moe_layer_end_index`` (-1: the last), every
    ``moe_layer_interval``-th; softmax routing in float32, experts chosen with the
    ``e_score_correction_bias`` and weighed without it, renormalised with the sum floored at
    ``moe_norm_min``; ``moe_num_shared_experts`` ungated shared experts as one MLP."""
    num_experts = _int(raw, "moe_num_experts", 64)
    start = _int(raw, "moe_layer_start_index", 1)
    end = raw.get("moe_layer_end_index", -1)
    end = num_layers - 1 if end in (-1, None) else _int(raw, "moe_layer_end_index", num_layers - 1)
    interval = max(_int(raw, "moe_layer_interval", 1), 1)
    layers = tuple(i for i in range(num_layers)
                   if num_experts > 0 and start <= i <= end and (i + 1) % interval == 0)
    if not layers:
        return None
    width = _int(raw, "moe_intermediate_size", 1536)
    floor = float(raw.get("moe_norm_min", 1e-12))
    routing = Routing(_int(raw, "moe_k", 6), bias=True, renormalize=True, norm_floor=floor, router_dtype="float32")
    return MoEConfig(num_experts, width, routing, layers,
                     shared_intermediate_size=width * _int(raw, "moe_num_shared_experts", 2))


def _ernie4_5_vl_moe(raw: dict[str, Any], num_layers: int) -> MoEConfig | None:
    """ERNIE-4.5-VL: ERNIE-4.5-MoE's routing, twice: text experts for text tokens, vision experts
    (their own count and width: ``moe_num_experts`` and ``moe_intermediate_size`` may be
    [text, vision] pairs) for an item's tokens; the sparse layers are ``mlp_layer_types``'. Absent,
    transformers' config (model_type ``ernie4_5_vl_moe``) makes all but layer 0 sparse and reads no
    ``moe_layer_*`` key; Baidu's remote-code config.json (``ernie4_5_moe_vl``) has ERNIE-4.5-MoE's rule."""
    types = raw.get("mlp_layer_types")
    if types is None and raw.get("model_type") == "ernie4_5_vl_moe":
        types = ["dense"] + ["sparse"] * (num_layers - 1)
    if isinstance(types, list):   # every layer a candidate: the types pick
        raw = raw | {"moe_layer_start_index": 0, "moe_layer_end_index": -1, "moe_layer_interval": 1}
    text = _ernie4_5_moe(raw | {"moe_num_experts": _pair(raw, "moe_num_experts", 64)[0],
                                "moe_intermediate_size": _pair(raw, "moe_intermediate_size", (1536, 512))[0]},
                         num_layers)
    if isinstance(types, list):
        layers = tuple(i for i, kind in enumerate(types[:num_layers]) if kind == "sparse")
    else:
        layers = text.layers if text is not None else ()
    if text is None or not layers:
        return None
    experts, width = _pair(raw, "moe_num_experts", 64)[1], _pair(raw, "moe_intermediate_size", (1536, 512))[1]
    return replace(text, layers=layers, vision=MoEConfig(experts, width, text.routing, layers))


def _pair(raw: dict[str, Any], key: str, default: int | tuple[int, int]) -> tuple[int, int]:
    """A (text, vision) pair from an int (both) or a two-element list."""
    value = raw.get(key, default)
    values = value if isinstance(value, (list, tuple)) else (value, value)
    if len(values) != 2:
        raise ModelLoadError(f"config.json's {key!r} must be an integer or a [text, vision] pair (got {value!r}).",
                             fix="fix the model's config.json (compare with the original checkpoint's).")
    return _int({key: values[0]}, key, 0), _int({key: values[1]}, key, 0)


def _glm4_moe(raw: dict[str, Any], num_layers: int) -> MoEConfig | None:
    """GLM-4.5-MoE: layers from ``first_k_dense_replace`` on; grouped sigmoid routing in float32
    (selection bias, ``topk_group`` of ``n_group`` groups), renormalised when ``norm_topk_prob``
    (transformers adds 1e-20 to the sum: a floor of 1e-20 is the same for positive scores), always
    times ``routed_scaling_factor``; ``n_shared_experts`` ungated shared experts as one MLP."""
    num_experts = _int(raw, "n_routed_experts", _int(raw, "num_local_experts", 128))
    first_moe = _int(raw, "first_k_dense_replace", 1)
    layers = tuple(range(first_moe, num_layers)) if num_experts > 0 else ()
    if not layers:
        return None
    scaling = raw.get("routed_scaling_factor", 1.0)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        raise ModelLoadError(f"config.json's 'routed_scaling_factor' must be a number (got {scaling!r}).",
                             fix="fix the model's config.json (compare with the original checkpoint's).")
    routing = Routing(_int(raw, "num_experts_per_tok", 8), scoring="sigmoid", bias=True,
                      num_groups=_int(raw, "n_group", 1), topk_groups=_int(raw, "topk_group", 1),
                      renormalize=bool(raw.get("norm_topk_prob", True)), norm_floor=1e-20, scaling=float(scaling),
                      router_dtype="float32")
    width = _int(raw, "moe_intermediate_size", 1408)
    return MoEConfig(num_experts, width, routing, layers,
                     shared_intermediate_size=width * _int(raw, "n_shared_experts", 1))


PARSERS: dict[str, Callable[[dict[str, Any], int], MoEConfig | None]] = {
    "Qwen2MoeForCausalLM": _qwen2_moe,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Ernie4_5_MoeForCausalLM": _ernie4_5_moe,
    "Glm4MoeForCausalLM": _glm4_moe,
    "Ernie4_5_VLMoeForConditionalGeneration": _ernie4_5_vl_moe,
}


def parse_moe(raw: dict[str, Any], architecture: str, num_layers: int) -> MoEConfig | None:
    """The checkpoint's MoE config, None for a dense model (or a MoE one whose layers are all dense)."""
    parser = PARSERS.get(architecture)
    moe = parser(raw, num_layers) if parser else None
    for part in (moe, moe.vision if moe is not None else None):
        if part is None:
            continue
        problems = part.routing.problems(part.num_experts)
        if part.intermediate_size <= 0:
            problems.append(f"moe_intermediate_size={part.intermediate_size} must be positive")
        if problems:
            raise ModelLoadError(f"{architecture}'s MoE config is inconsistent: {'; '.join(problems)}.",
                                 fix="fix the model's config.json (compare with the original checkpoint's).")
    return moe
