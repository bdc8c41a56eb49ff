"""FP8 weights row by row: per-row scales from a tile grid, dequantized rows, and row ops on fp8 bytes.

Shared by the FP8 linear layer (`fdplug.core.model.layers.fp8_linear`), the portable ``fp8_linear``
op and the reference MoE (`fdplug.core.portable`); the format itself is `fdplug.plugin_api.fp8`'s.
"""

from __future__ import annotations

from typing import Any

import paddle

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
