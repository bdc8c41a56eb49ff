"""The decoder's small building blocks (norms, SwiGLU, rotary embedding) and the linear of each
weight format (`make_linear`), in plain Paddle ops so every device runs them.

Tokens of all sequences of a step are flat rows ``[T, ...]`` (no batch dimension).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import paddle
from paddle import nn

from fdplug.core.model.checkpoint.gguf_weights import GgufLayout
from fdplug.core.model.checkpoint.rope import RopeConfig, cos_sin
from fdplug.core.model.layers.fp8_linear import Fp8Linear
from fdplug.core.model.layers.gguf_linear import GgufLinear
from fdplug.core.model.layers.linear import Linear, empty_parameter
from fdplug.core.portable.ops import PORTABLE
from fdplug.plugin_api.ops import Kernels


class RMSNorm(nn.Layer):
    """``weight * x / rms(x)`` through the selected ``rms_norm`` kernel (`fdplug.plugin_api.ops`);
    `add` is the pre-norm block's residual add and this norm in one ``add_rms_norm`` op.

    ``shape`` may have a leading head axis (``[heads, head_dim]``): Qwen3's q/k norms share one
    weight per head, and stacking the q and k weights lets a single norm serve both.
    """

    def __init__(self, shape: int | list[int], eps: float, dtype: str, kernels: Kernels = PORTABLE) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter([shape] if isinstance(shape, int) else list(shape), dtype)
        self.kernel = kernels.rms_norm
        self.add_kernel = kernels.add_rms_norm

    def forward(self, x: Any) -> Any:
        return self.kernel(x, self.weight, self.eps)

    def add(self, x: Any, residual: Any) -> tuple[Any, Any]:
        """``(norm(x + residual), x + residual)``."""
        return self.add_kernel(x, residual, self.weight, self.eps)


def make_linear(in_features: int, out_features: int, bias: bool, dtype: str, quant: Any = None,
                kernels: Kernels = PORTABLE, bf16: bool = False) -> nn.Layer:
    """A `Linear` (bf16 weights when ``bf16``, `ModelConfig.bf16_weights`), an
    `fp8_linear.Fp8Linear` (running the ``fp8_linear`` op of ``kernels``) when ``quant`` (a
    `QuantConfig`) says the checkpoint's is FP8, or a `gguf_linear.GgufLinear` for a GGUF file's
    blocks (``quant`` a `gguf_weights.GgufLayout`)."""
    if isinstance(quant, GgufLayout):
        return GgufLinear(in_features, out_features, bias, dtype, quant, kernels.gguf_linear)
    if quant is not None:
        return Fp8Linear(in_features, out_features, bias, dtype, quant, kernels.fp8_linear)
    return Linear(in_features, out_features, bias, dtype, kernels.linear, "bfloat16" if bf16 else dtype)


class SwiGLU(nn.Layer):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one ``[hidden, 2*inter]`` matmul.

    ``activation`` is the selected ``swiglu`` kernel: ``[..., 2*inter]`` to ``silu(first half) *
    second half`` (`fdplug.plugin_api.ops`).
    """

    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: str, kernels: Kernels = PORTABLE,
                 quant: tuple[Any, Any] = (None, None), bf16: bool = False) -> None:
        """``quant``: the `QuantConfig` of the fused gate/up and of the down projection (None: float);
        ``bf16``: float weights kept bf16 (`make_linear`)."""
        super().__init__()
        self.gate_up_proj = make_linear(hidden, 2 * intermediate, bias, dtype, quant[0], kernels, bf16)
        self.down_proj = make_linear(intermediate, hidden, bias, dtype, quant[1], kernels, bf16)
        self.activation: Callable[[Any], Any] = kernels.swiglu

    def forward(self, x: Any) -> Any:
        return self.down_proj(self.activation(self.gate_up_proj(x)))


class RotaryEmbedding(nn.Layer):
    """NeoX-style RoPE from precomputed tables indexed by each token's position.

    ``x * cos + roll(x, d/2) * sin_signed`` where ``sin_signed`` holds ``-sin`` in its first half:
    that is ``x * cos + rotate_half(x) * sin``, the selected ``rope`` op (`fdplug.plugin_api.ops`).
    Interleaved (GPT-J) and partial-rotary checkpoints are permuted to this layout at load time (see
    ``rope.rope_permutation``).

    ``lookup`` tiles the rows over the ``heads`` that get rotated, once per step for every layer:
    on Paddle's CPU a broadcasting multiply ``[T, H, D] * [T, 1, D]`` took 10 ms where the
    same-shape one took 0.4 ms (2048 tokens, 12 heads).
    """

    def __init__(self, rope: RopeConfig, head_dim: int, num_positions: int, dtype: str, heads: int = 1,
                 kernels: Kernels = PORTABLE) -> None:
        super().__init__()
        self.heads = heads
        self.kernel = kernels.rope
        cos, sin = cos_sin(rope, head_dim, num_positions)
        half = head_dim // 2
        sin = np.concatenate([-sin[:, :half], sin[:, half:]], axis=-1)
        self.half = half
        self.num_positions = num_positions
        self.register_buffer("cos", paddle.to_tensor(cos).astype(dtype), persistable=False)
        self.register_buffer("sin", paddle.to_tensor(sin).astype(dtype), persistable=False)

    def lookup(self, positions: Any) -> tuple[Any, Any]:
        """``cos``, ``sin`` rows for ``positions [T]``, tiled to ``[T, heads, head_dim]``."""
        return tuple(paddle.gather(table, positions).unsqueeze(1).tile([1, self.heads, 1])
                     for table in (self.cos, self.sin))

    def forward(self, x: Any, cos: Any, sin: Any) -> Any:
        """Rotate ``x [T, heads, head_dim]``."""
        return self.kernel(x, cos, sin)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL, ERNIE-4.5-VL): each token has three positions (temporal, height,
    width) and frequency ``f`` rotates by the one `RopeConfig.mrope_axes` assigns it, in both halves
    of the NeoX layout. The rows are picked from the same tables by masks of ones and zeros, so a text
    token (three equal positions) gets exactly `RotaryEmbedding`'s rows."""

    def __init__(self, rope: RopeConfig, head_dim: int, num_positions: int, dtype: str, heads: int = 1,
                 kernels: Kernels = PORTABLE) -> None:
        super().__init__(rope, head_dim, num_positions, dtype, heads, kernels)
        axis = rope.mrope_axes()
        axis = np.concatenate([axis, np.full(head_dim // 2 - len(axis), 2)])   # partial rotary: passing dims
        masks = (np.tile(axis, 2)[None, :] == np.arange(3)[:, None]).astype(np.float32)
        self.register_buffer("axis_masks", paddle.to_tensor(masks[:, None, :]).astype(dtype), persistable=False)

    def lookup(self, positions: Any) -> tuple[Any, Any]:
        """``positions [3, T]`` (temporal, height, width) -> ``cos``, ``sin`` ``[T, heads, head_dim]``."""
        num = positions.shape[-1]
        flat = positions.reshape([-1])
        return tuple((paddle.gather(table, flat).reshape([3, num, -1]) * self.axis_masks).sum(axis=0)
                     .unsqueeze(1).tile([1, self.heads, 1]) for table in (self.cos, self.sin))


def use_row_kernels(model: nn.Layer, kernels: Kernels) -> None:
    """Point every norm, MLP activation and RoPE of ``model`` at ``kernels``' ``rms_norm``,
    ``add_rms_norm``, ``swiglu`` and ``rope``: after load, where startup timing gave an op the
    portable kernel instead (`fdplug.core.worker.row_op_timing`)."""
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, RMSNorm):
            layer.kernel, layer.add_kernel = kernels.rms_norm, kernels.add_rms_norm
        elif isinstance(layer, SwiGLU):
            layer.activation = kernels.swiglu
        elif isinstance(layer, RotaryEmbedding):
            layer.kernel = kernels.rope
