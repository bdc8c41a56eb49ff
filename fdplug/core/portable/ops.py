"""The portable kernel of every op in `fdplug.plugin_api.ops` (its contracts are written there)."""

from __future__ import annotations

from typing import Any

import paddle
import paddle.nn.functional as F

from fdplug.core.portable.vision_attention import vision_attention
from fdplug.plugin_api.ops import Kernels


def swiglu(x: Any) -> Any:
    return F.swiglu(x)


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    h = x if x.dtype == paddle.float32 else x.astype("float32")
    h = h * paddle.rsqrt((h * h).mean(axis=-1, keepdim=True) + eps)
    return weight * (h if h.dtype == x.dtype else h.astype(x.dtype))


def fp8_linear(x: Any, weight: Any, weight_scale: Any, block_k: int) -> Any:
    """The whole layer dequantized to ``x``'s dtype, then one matmul with the weight as stored."""
    from fdplug.core.quant.fp8_rows import dequant_rows

    w = dequant_rows(weight, weight_scale, block_k, "float32")
    return paddle.matmul(x, w if w.dtype == x.dtype else w.astype(x.dtype), transpose_y=True)


def linear(x: Any, weight: Any) -> Any:
    """One matmul with the weight as stored (``[N, K]``); a bf16 weight under other activations is
    cast to their dtype first, a copy of the layer per call."""
    return paddle.matmul(x, weight if weight.dtype == x.dtype else weight.astype(x.dtype), transpose_y=True)


def gguf_linear(x: Any, weight: Any, qtype: str, k: int) -> Any:
    """The whole layer dequantized from its GGML blocks to ``x``'s dtype, then one matmul."""
    from fdplug.core.quant.gguf_blocks import dequantize

    return paddle.matmul(x, dequantize(weight, qtype, k, str(x.dtype).removeprefix("paddle.")), transpose_y=True)


def add_rms_norm(x: Any, residual: Any, weight: Any, eps: float) -> tuple[Any, Any]:
    total = x + residual
    return rms_norm(total, weight, eps), total


def rope(x: Any, cos: Any, sin: Any) -> Any:
    return x * cos + paddle.roll(x, x.shape[-1] // 2, axis=-1) * sin


def argmax(logits: Any) -> Any:
    return logits.argmax(axis=1).numpy().astype("int64")


def decoder_stack(stack: Any) -> str:
    """The portable model runs its layers one by one, each op through its selected kernel."""
    return "the layers run one by one (paddle_layer_by_layer)"


PORTABLE = Kernels(swiglu=swiglu, rms_norm=rms_norm, fp8_linear=fp8_linear, linear=linear,
                   add_rms_norm=add_rms_norm, rope=rope, argmax=argmax, gguf_linear=gguf_linear,
                   decoder_stack=decoder_stack, vision_attention=vision_attention)
"""The table a model gets when nobody chose kernels for it (tests, tools)."""
