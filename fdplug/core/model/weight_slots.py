"""Where each tensor of a Hugging Face checkpoint goes in `DecoderForCausalLM`: one `Slot` per tensor.

HF ``nn.Linear`` weights are ``[out, in]``, ours ``[in, out]``; q/k/v, gate/up and the experts of a
MoE layer are fused, so several tensors share one parameter. `loader.load_weights` (and the GGUF
loader) fill the slots: `assign_pieces` fuses a parameter's pieces once all are read, and
`hand_over_experts` gives a MoE layer's experts to its backend once both are filled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import paddle

from fdplug.core.model.checkpoint.config import ModelConfig
from fdplug.core.model.checkpoint.quant_config import (
    QuantConfig,
    fused_quant,
    mlp_quant,
    shared_expert_prefix,
)
from fdplug.core.model.checkpoint.rope import rope_permutation
from fdplug.core.model.layers.moe_block import EXPERT_PARAMS
from fdplug.core.quant.fp8_rows import fp8_rows


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one checkpoint tensor goes.

    ``kind``: ``copy`` (same layout), ``linear`` (HF ``[out, in]`` -> columns ``start:stop`` of an
    ``[in, out]`` parameter), ``vec`` (a bias -> entries ``start:stop``), ``heads`` (one per-head
    norm weight ``[D]`` -> rows ``start:stop`` of a ``[heads, D]`` parameter), ``stack`` (one expert's
    ``[out, in]`` -> rows ``start:stop`` of the experts stacked along rows, kept in HF layout). ``permute`` applies
    `rope.rope_permutation` to each head's dimensions (q and k of interleaved or partial RoPE). A parameter
    fed by several slots is assembled when its last piece arrives, whichever shard holds it.
    """

    param: str
    shape: tuple[int, ...]
    kind: str = "copy"
    start: int = 0
    stop: int = 0
    permute: bool = False
    scale_rows: int = 0     # a block-scale grid: repeat each row this many times (then crop) first


def proj_slots(src: str, dst: str, shape: tuple[int, int], start: int, stop: int, permute: bool,
               quant: Any) -> dict[str, Slot]:
    """One HF linear ``src`` (``[N, K]``) as rows ``start:stop`` of the projection ``dst``, as stored:
    into a `layers.Linear` (in its weight dtype), or into an `fp8_layers.Fp8Linear` with its scale
    grid ``weight_scale_inv`` expanded to one row of scales per weight row."""
    if not isinstance(quant, QuantConfig):   # float, or a GGUF file's blocks (rows of bytes, no scale tensor)
        return {src + "weight": Slot(dst + "weight", shape, "rows", start, stop, permute)}
    (bn, bk), (n, k) = quant.block, shape
    return {src + "weight": Slot(dst + "weight", shape, "rows", start, stop, permute),
            src + "weight_scale_inv": Slot(dst + "weight_scale", (-(-n // bn), -(-k // bk)), "rows", start, stop,
                                           permute, scale_rows=bn)}


def weight_slots(cfg: ModelConfig, fused_experts: bool = False) -> dict[str, Slot]:
    """HF tensor name -> slot, for every tensor the checkpoint must hold (``fused_experts``: MoE
    experts stored as ``experts.gate_up_proj``/``experts.down_proj`` rather than per expert)."""
    hid, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    permute_qk = rope_permutation(cfg.rope, d) is not None
    slots = {"model.embed_tokens.weight": Slot("embed_tokens", (cfg.vocab_size, hid)),
             "model.norm.weight": Slot("norm.weight", (hid,))}
    if not cfg.tie_word_embeddings:
        slots["lm_head.weight"] = Slot("lm_head.weight", (cfg.vocab_size, hid))
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        slots[src + "input_layernorm.weight"] = Slot(dst + "input_layernorm.weight", (hid,))
        slots[src + "post_attention_layernorm.weight"] = Slot(dst + "post_attention_layernorm.weight", (hid,))
        offset = 0
        attn = src + "self_attn."
        qkv_quant = fused_quant(cfg.quant, attn, ("q_proj", "k_proj", "v_proj"))
        for name, n in (("q", heads), ("k", kv), ("v", kv)):
            rows = (offset * d, (offset + n) * d)
            permute = permute_qk and name != "v"
            slots |= proj_slots(attn + f"{name}_proj.", dst + "self_attn.qkv_proj.", (n * d, hid), *rows, permute,
                                qkv_quant)
            if cfg.attention_bias:
                slots[src + f"self_attn.{name}_proj.bias"] = Slot(dst + "self_attn.qkv_proj.bias", (n * d,),
                                                                  "vec", *rows, permute)
            offset += n
        slots |= proj_slots(attn + "o_proj.", dst + "self_attn.o_proj.", (hid, heads * d), 0, hid, False,
                            fused_quant(cfg.quant, attn, ("o_proj",)))
        if cfg.o_proj_bias:
            slots[src + "self_attn.o_proj.bias"] = Slot(dst + "self_attn.o_proj.bias", (hid,))
        if cfg.qk_norm:
            for name, (start, stop) in (("q", (0, heads)), ("k", (heads, heads + kv))):
                slots[src + f"self_attn.{name}_norm.weight"] = Slot(dst + "self_attn.qk_norm.weight", (d,),
                                                                    "heads", start, stop, permute_qk)
        if cfg.moe is not None and i in cfg.moe.layers and cfg.moe.vision is not None:
            slots |= modality_moe_slots(cfg, src + "mlp.", dst + "mlp.")
        elif cfg.moe is not None and i in cfg.moe.layers:
            slots |= moe_slots(cfg, src + "mlp.", dst + "mlp.", fused_experts)
        else:
            slots |= swiglu_slots(src + "mlp.", dst + "mlp.", hid, inter, cfg.mlp_bias, cfg.quant)
    return slots


def swiglu_slots(src: str, dst: str, hid: int, inter: int, bias: bool,
                 quant: QuantConfig | None = None) -> dict[str, Slot]:
    """An HF gate/up/down MLP into a `layers.SwiGLU` (gate and up fused into one matmul)."""
    slots = {}
    gate_up_quant, down_quant = mlp_quant(quant, src)
    for name, cols in (("gate", (0, inter)), ("up", (inter, 2 * inter))):
        slots |= proj_slots(src + f"{name}_proj.", dst + "gate_up_proj.", (inter, hid), *cols, False, gate_up_quant)
        if bias:
            slots[src + f"{name}_proj.bias"] = Slot(dst + "gate_up_proj.bias", (inter,), "vec", *cols)
    slots |= proj_slots(src + "down_proj.", dst + "down_proj.", (hid, inter), 0, hid, False, down_quant)
    if bias:
        slots[src + "down_proj.bias"] = Slot(dst + "down_proj.bias", (hid,))
    return slots


def moe_slots(cfg: ModelConfig, src: str, dst: str, fused_experts: bool) -> dict[str, Slot]:
    """A MoE MLP into a `moe_block.SparseMoEBlock`: router, selection bias, shared expert and routed
    experts, the latter per expert (``experts.E.gate_proj.weight``...), fused (``experts.gate_up_proj``)
    or, from a GGUF file, stacked per projection (``experts.gate_proj.weight`` ``[E, I, H]``)."""
    moe, hid = cfg.moe, cfg.hidden_size
    e, inter = moe.num_experts, moe.intermediate_size
    slots = {src + "gate.weight": Slot(dst + "router", (e, hid), "linear", 0, e)}
    if moe.routing.bias and cfg.architecture == "Glm4MoeForCausalLM":   # a [E] buffer of the router
        slots[src + "gate.e_score_correction_bias"] = Slot(dst + "e_score_correction_bias", (e,), "stack", 0, 1)
    elif moe.routing.bias:                                               # ERNIE-4.5's [1, E] statistic
        slots[src + "moe_statics.e_score_correction_bias"] = Slot(dst + "e_score_correction_bias", (1, e))
    if moe.shared_intermediate_size:
        layer = src.removesuffix("mlp.")
        slots |= swiglu_slots(shared_expert_prefix(layer, moe.shared_gate), dst + "shared_expert.", hid,
                              moe.shared_intermediate_size, False, cfg.quant)
    if moe.shared_gate:
        slots[src + "shared_expert_gate.weight"] = Slot(dst + "shared_expert_gate", (1, hid), "linear", 0, 1)
    if cfg.gguf:   # a GGUF file's stacks [E, rows, cols], gate and up apart (`moe_block.SparseMoEBlock`)
        for name, shape in (("gate", (e, inter, hid)), ("up", (e, inter, hid)), ("down", (e, hid, inter))):
            slots[src + f"experts.{name}_proj.weight"] = Slot(dst + f"experts_{name}", shape, "stack", 0, e)
        return slots
    quant = fused_quant(cfg.quant, src + "experts.", ("gate_proj", "up_proj", "down_proj"))
    if fused_experts:   # FP8: transformers' FP8 experts name the scale grids ``<weight>_scale_inv``
        for name, param, (n, k) in (("gate_up_proj", "experts_gate_up", (2 * inter, hid)),
                                    ("down_proj", "experts_down", (hid, inter))):
            slots[src + f"experts.{name}"] = Slot(dst + param, (e, n, k))
            if quant is not None:
                (bn, bk) = quant.block
                slots[src + f"experts.{name}_scale_inv"] = Slot(dst + param + "_scale", (e, -(-n // bn), -(-k // bk)),
                                                                "copy", 0, n, scale_rows=bn)
        return slots
    return slots | per_expert_slots(src, dst, e, inter, hid, quant)


def per_expert_slots(src: str, dst: str, e: int, inter: int, hid: int, quant: QuantConfig | None = None,
                     first: int = 0) -> dict[str, Slot]:
    """Experts ``first..first+e-1`` stored one by one (``experts.X.gate_proj.weight``...) as rows of the
    block's stacked ``[E * 2I, H]`` and ``[E * H, I]`` matrices (its experts ``0..e-1``)."""
    slots = {}
    for x in range(e):
        gate_rows, up_rows = (2 * x * inter, (2 * x + 1) * inter), ((2 * x + 1) * inter, (2 * x + 2) * inter)
        for name, rows, shape, param in (("gate", gate_rows, (inter, hid), "experts_gate_up"),
                                         ("up", up_rows, (inter, hid), "experts_gate_up"),
                                         ("down", (x * hid, (x + 1) * hid), (hid, inter), "experts_down")):
            key = src + f"experts.{first + x}.{name}_proj."
            slots[key + "weight"] = Slot(dst + param, shape, "stack", *rows)
            if quant is not None:
                (bn, bk), (n, k) = quant.block, shape
                slots[key + "weight_scale_inv"] = Slot(dst + param + "_scale", (-(-n // bn), -(-k // bk)), "stack",
                                                       *rows, scale_rows=bn)
    return slots


def modality_moe_slots(cfg: ModelConfig, src: str, dst: str) -> dict[str, Slot]:
    """ERNIE-4.5-VL's MoE MLP (`modality_moe.ModalityMoE`) as its checkpoint stores it: the text
    experts ``0..E-1`` then the vision experts, routers ``gate.weight`` and ``gate.weight_1`` stored
    ``[hidden, E]``, one ``[2, E]`` selection bias, the shared experts."""
    moe, hid = cfg.moe, cfg.hidden_size
    slots = {src + "gate.weight": Slot(dst + "text.router", (hid, moe.num_experts)),
             src + "gate.weight_1": Slot(dst + "vision.router", (hid, moe.vision.num_experts))}
    if moe.routing.bias:
        slots[src + "moe_statics.e_score_correction_bias"] = Slot(dst + "e_score_correction_bias",
                                                                  (2, moe.num_experts))
    if moe.shared_intermediate_size:
        slots |= swiglu_slots(src + "shared_experts.", dst + "shared_expert.", hid, moe.shared_intermediate_size,
                              cfg.mlp_bias)
    slots |= per_expert_slots(src, dst + "text.", moe.num_experts, moe.intermediate_size, hid)
    return slots | per_expert_slots(src, dst + "vision.", moe.vision.num_experts, moe.vision.intermediate_size, hid,
                                    first=moe.num_experts)


def assign_pieces(param: Any, parts: list[tuple[Slot, Any]]) -> None:
    """Fuse a parameter's pieces in HF layout (rows in ``start`` order), convert once, assign.

    Concatenating ``[out, in]`` pieces along rows is a contiguous copy; the single transpose that
    follows goes through ``paddle.assign``, which is several times faster than ``set_value`` of a
    transposed view on CPU.
    """
    parts.sort(key=lambda part: part[0].start)
    kind = parts[0][0].kind
    if kind == "heads":  # one [D] norm weight per head range
        values = [v.unsqueeze(0).expand([s.stop - s.start, v.shape[0]]) for s, v in parts]
    else:
        values = [v for _, v in parts]
    value = values[0] if len(values) == 1 else fp8_rows(values, lambda vs: paddle.concat(vs, axis=0))
    if kind == "stack":
        value = value.reshape(param.shape)
    if kind == "linear":
        value = paddle.transpose(value, [1, 0])
    device = paddle.device.get_device()
    if device != "cpu":
        value = value.to(device)  # safetensors hands out host tensors
    paddle.assign(value, param)


def hand_over_experts(model: Any, param: str, pending: dict[str, int]) -> None:
    """Once both expert parameters of a MoE layer are filled, its backend takes them over (one layer
    at a time, so the stacked copies of only one layer are alive at once)."""
    prefix, _, name = param.rpartition(".")
    if name in EXPERT_PARAMS and all(pending.get(f"{prefix}.{other}", 0) == 0 for other in EXPERT_PARAMS):
        model.get_sublayer(prefix).load_experts()
