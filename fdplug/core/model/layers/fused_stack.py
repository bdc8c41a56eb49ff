"""The loaded decoder described for the ``decoder_stack`` op, and its answer attached to the model.

The op (`fdplug.plugin_api.ops`) gets a `DecoderStack` once after load and either runs every layer
of a step in one call from then on (`DecoderForCausalLM.fused_stack`), or says why not; the
model then runs its layers one by one, as it always can. A MoE model, FP8 linears or expert
parallel are not described: there is nothing to hand over (the reason says so).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fdplug.core.model.layers.basic import SwiGLU
from fdplug.core.model.layers.decoder import Attention, DecoderForCausalLM
from fdplug.core.model.layers.gguf_linear import GgufLinear
from fdplug.core.model.layers.linear import Linear
from fdplug.core.portable.op_specs import PORTABLE_OPS
from fdplug.core.portable.ops import PORTABLE
from fdplug.plugin_api.decoder_stack import DecoderStack, StackLayer, StackLinear
from fdplug.plugin_api.ops import Kernels
from fdplug.plugin_api.selection import Selection

OPS_INSIDE = ("rms_norm", "rope", "swiglu")
"""The row ops a decode step does not call once a stack is attached: the layers' (their norms, RoPE,
MLP activation) run inside it; the final norm's ``add_rms_norm`` and the sampler's ``argmax`` still
run (`DecoderForCausalLM._forward`). Their one-row figure does not decide their kernel then
(`fdplug.core.worker.row_op_timing`)."""


def _linear(layer: Any, ops: Mapping[str, str]) -> StackLinear | str:
    """The layer as the stack gets it, or why it cannot: the stack runs the ops' kernels, so a layer
    on the portable op where a kernel is selected (measured faster on its shape,
    `fdplug.core.worker.op_timing`) keeps it off."""
    if (isinstance(layer, GgufLinear) and PORTABLE.gguf_linear in layer.kernels
            and ops.get("gguf_linear") != PORTABLE_OPS["gguf_linear"].name
            or isinstance(layer, Linear) and layer.kernel is PORTABLE.linear
            and ops.get("linear") != PORTABLE_OPS["linear"].name):
        return ("a decoder layer's projection runs the portable op (measured faster than the kernel on its shape; "
                "--op-kernel names the kernel for every shape)")
    if isinstance(layer, GgufLinear):
        groups = tuple((w, qtype) for w, (qtype, _) in zip(layer.kernel_weights, layer.layout.groups, strict=True))
        return StackLinear("gguf", groups, layer.in_features, layer.layout.rows, layer.bias)
    if isinstance(layer, Linear):
        out_features, in_features = (layer.prepared.shape if layer.prepared is not None else layer.weight.shape)
        dtype = str(layer.weight.dtype).removeprefix("paddle.")
        return StackLinear("float", ((layer.kernel_weight, dtype),), int(in_features), int(out_features),
                           None if layer.prepared is not None else layer.bias)
    return "FP8 linear layers are not described for a fused stack"


def describe(model: DecoderForCausalLM, ops: Mapping[str, str], attention: str) -> DecoderStack | str:
    """The model's layers as a `DecoderStack`, or why they cannot be described."""
    cfg = model.config
    if model.expert_parallel is not None or cfg.moe is not None:
        return "a MoE model's layers are not fused (its experts run through the MoE backend)"
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, Attention) or not isinstance(mlp, SwiGLU):
            return f"layer {len(layers)} is not the dense decoder layer"
        linears = [_linear(p, ops) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        reason = next((linear for linear in linears if isinstance(linear, str)), None)
        if reason is not None:
            return reason
        layers.append(StackLayer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *linears,
                                 qk_norm=None if attn.qk_norm is None else attn.qk_norm.weight))
    table = model.embedding_table()   # (the lm_head's packed copy where the file's table was dropped)
    embedding = (StackLinear("gguf", ((table, model.embed_type),), cfg.hidden_size, cfg.vocab_size)
                 if model.embed_type is not None else
                 StackLinear("float", ((table, str(table.dtype).removeprefix("paddle.")),), cfg.hidden_size,
                             cfg.vocab_size))
    return DecoderStack(tuple(layers), cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                        cfg.head_dim, cfg.rms_norm_eps, model.layers[0].self_attn.scale, model.dtype_name,
                        dict(ops), attention, embedding)


def attach(model: DecoderForCausalLM, kernels: Kernels, selection: Selection) -> str:
    """Hand the described layers to the selected ``decoder_stack`` kernel; the model keeps what it
    returns. -> a line for the startup log: what runs a decode step's layers, and why."""
    ops = {op: spec.name for op, spec in selection.ops.items()}
    stack = describe(model, ops, selection.attention.name)
    answer = stack if isinstance(stack, str) else kernels.decoder_stack(stack)
    if isinstance(answer, str):
        model.fused_stack = None
        return f"decoder stack: layer by layer ({answer})"
    model.fused_stack = answer
    return f"decoder stack: {ops['decoder_stack']} (every layer of a decode step in one call)"
