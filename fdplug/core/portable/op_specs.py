"""The portable kernel of each op as the `OpSpec` the core registers for every device, and the
reference attention and MoE backends' specs.

Kept here, not only in the core plugin's hook: a kernel or a backend that startup timing finds
slower than the portable one gives way to this very spec (`fdplug.core.worker.row_op_timing`,
`fdplug.core.worker.backend_timing`), so the selection then names it as if it had been chosen.
"""

from __future__ import annotations

from fdplug.core.portable import PORTABLE_LINEAR
from fdplug.plugin_api.specs import ANY_DEVICE, AttentionBackendSpec, MoEBackendSpec, OpSpec


def _op_factory(op: str):
    def factory(config):
        from fdplug.core.portable import ops

        return getattr(ops, op)
    return factory


def _portable_op(op: str, description: str, name: str = "") -> OpSpec:
    return OpSpec(name=name or f"paddle_{op}", op=op, devices=(ANY_DEVICE,), factory=_op_factory(op),
                  description=description)


PORTABLE_OPS: dict[str, OpSpec] = {spec.op: spec for spec in (
    _portable_op("swiglu", "paddle.nn.functional.swiglu"),
    _portable_op("rms_norm", "float32 mean of squares, rsqrt, weight (four Paddle ops)"),
    _portable_op("fp8_linear", "the FP8 layer dequantized to the compute dtype, then one paddle matmul"),
    _portable_op("gguf_linear", "the layer's GGML blocks dequantized to the compute dtype, then one paddle matmul"),
    _portable_op("add_rms_norm", "one Paddle add, then paddle_rms_norm"),
    _portable_op("rope", "x * cos + roll(x, D/2) * sin (four Paddle ops)"),
    _portable_op("argmax", "paddle's argmax over each row, copied to the host"),
    _portable_op("decoder_stack", "no fused stack: each layer's ops run one by one through their selected kernels",
                 name="paddle_layer_by_layer"),
    _portable_op("vision_attention", "softmax attention per segment, equal-length segments batched in one matmul"),
    _portable_op("linear", "one paddle matmul of the weights as stored (bf16 weights under float32 activations: "
                 "cast first, a copy per call)", name=PORTABLE_LINEAR))}
"""Each op's portable kernel (`fdplug.core.portable.ops`), by op."""


def _attention_factory(config):
    from fdplug.core.portable.attention import ReferenceAttention

    return ReferenceAttention()


def _moe_factory(config):
    from fdplug.core.portable.moe import ReferenceMoE

    return ReferenceMoE()


REFERENCE_BACKENDS: dict[str, AttentionBackendSpec | MoEBackendSpec] = {
    "attention": AttentionBackendSpec(name="reference", devices=(ANY_DEVICE,), factory=_attention_factory,
                                      description="plain Paddle matmuls over the paged cache, masks from the mask "
                                                  "spec"),
    "moe": MoEBackendSpec(name="reference", devices=(ANY_DEVICE,), factory=_moe_factory,
                          weight_formats=("none", "fp8_block", "gguf"),
                          description="a Paddle loop over the experts that got tokens (fp8_block, gguf: each "
                                      "dequantized when it runs)")}
"""The core's reference backend of each role of `fdplug.plugin_api.selection.MEASURED_BACKENDS`."""
