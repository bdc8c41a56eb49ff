"""The portable kernel of each op as the `OpSpec` the core registers for every device.

Kept here, not only in the core plugin's hook: a kernel that startup timing finds slower than the
portable op gives way to this very spec (`fdplug.core.worker.row_op_timing`), so the selection then
names it as if it had been chosen.
"""

from __future__ import annotations

from fdplug.core.portable import PORTABLE_LINEAR
from fdplug.plugin_api.specs import ANY_DEVICE, OpSpec


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
