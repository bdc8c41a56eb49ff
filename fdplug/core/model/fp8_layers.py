"""The portable FP8 path: weights stay e4m3 in memory, each use dequantizes them to the compute dtype.

A checkpoint stores one float32 scale per ``bn x bk`` tile. Fused projections (q/k/v, gate/up, the
experts of a layer) join tensors whose tile grids need not line up (a k projection of 2 heads of
64 rows is half a 128-row tile), so the loader keeps the scales *per row*: ``[N, ceil(K / bk)]``,
each tile's scale repeated over its rows (`expand_scale_rows`). That costs ``4 / bk`` bytes per
weight (3% of the e4m3 bytes at bk = 128) and makes any row range, fusion or RoPE row permutation
of the weight a plain row operation on its scales too. It is also the layout Blackwell's kernels
read (one scale row per output row).

Every device runs this path (plain Paddle ops); it is the numerics reference for FP8 kernels and a
ceiling for them to beat, not a fast path: a layer's float weights exist only while it runs.
"""

from __future__ import annotations

from typing import Any

import paddle
from paddle import nn

from fdplug.core.model.layers import PreparedWeightMixin
from fdplug.core.model.quant_config import QuantConfig

FP8_DTYPE = "float8_e4m3fn"


def expand_scale_rows(scale_inv: Any, rows: int, block_n: int) -> Any:
    """A tile grid ``[..., ceil(rows / bn), C]`` -> per-row scales ``[..., rows, C]`` (float32)."""
    grid = scale_inv.astype("float32")
    if int(grid.shape[-2]) != -(-rows // block_n):
        raise ValueError(f"a scale grid of {grid.shape[-2]} row blocks does not cover {rows} rows of {block_n}")
    return paddle.repeat_interleave(grid, block_n, axis=grid.ndim - 2)[..., :rows, :]


def dequant_rows(weight: Any, scale_rows: Any, block_k: int, dtype: str) -> Any:
    """``weight [..., N, K]`` e4m3 times its per-row scales ``[..., N, ceil(K / bk)]``, as ``dtype``."""
    shape, blocks = list(weight.shape), int(scale_rows.shape[-1])
    w = weight.astype("float32")
    if shape[-1] == blocks * block_k:    # whole blocks: broadcast each scale over its block (half the time)
        w = (w.reshape(shape[:-1] + [blocks, block_k]) * scale_rows.unsqueeze(-1)).reshape(shape)
    else:
        w = w * paddle.repeat_interleave(scale_rows, block_k, axis=scale_rows.ndim - 1)[..., :shape[-1]]
    return w if dtype == "float32" else w.astype(dtype)


def fp8_rows(values: Any, op) -> Any:
    """Apply a row operation (gather, concat) that paddle has no fp8 kernel for to one tensor or a
    list of them, on their bytes: a uint8 view moves the same bits (80x faster than a round trip
    through float32, which paddle's scalar fp8 casts make slow on the host)."""
    many = isinstance(values, (list, tuple))
    first = values[0] if many else values
    if first.dtype != paddle.float8_e4m3fn:
        return op(values)
    as_bytes = [v.view(paddle.uint8) for v in values] if many else values.view(paddle.uint8)
    return op(as_bytes).view(paddle.float8_e4m3fn)


class Fp8Linear(PreparedWeightMixin, nn.Layer):
    """``x @ W^T (+ bias)`` with ``W`` kept as ``weight [out, in]`` e4m3 and ``weight_scale [out, ceil(in / bk)]``.

    HF layout (``[out, in]``, not transposed like `layers.Linear`): paddle cannot transpose-copy
    fp8 on every device, and ``matmul(transpose_y=True)`` reads it as stored.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str, quant: QuantConfig,
                 kernel: Any = None) -> None:
        """``kernel``: the selected ``fp8_linear`` op (`fdplug.plugin_api.ops`; default: the portable one)."""
        from fdplug.core.model.layers import empty_parameter
        from fdplug.core.portable.ops import PORTABLE

        super().__init__()
        self.dtype_name, self.block_k = dtype, quant.block[1]
        self.kernel = kernel or PORTABLE.fp8_linear
        self.weight = empty_parameter([out_features, in_features], FP8_DTYPE)
        self.weight_scale = empty_parameter([out_features, -(-in_features // self.block_k)], "float32")
        self.bias = empty_parameter([out_features], dtype) if bias else None

    def forward(self, x: Any) -> Any:
        return self.add_bias(self.kernel(x, self.kernel_weight, self.weight_scale, self.block_k))
