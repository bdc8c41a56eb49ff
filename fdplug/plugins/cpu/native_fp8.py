"""``cpu_native_fp8_linear``: the ``fp8_linear`` op with FP8 weights read in place.

The portable op dequantizes a whole layer per call: paddle's CPU casts from float8 are scalar, so a
4096x1024 layer took 25-30 ms to widen before a 0.4 ms GEMV. ``fdplug_fp8_linear`` (csrc) widens
each 16 weights in registers and feeds them to FMAs for up to 8 rows: the weights stay one byte in
memory and are read once per call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fdplug.plugins.cpu.kernels import _check_float32, _contiguous, load

# Up to this many rows the weights are widened in registers; above, one dequantized copy of the
# layer and paddle's GEMM catch up (the widening is repeated for every 8 rows). Measured on this
# 2-core machine, 1536x512 and 4096x1024 layers: the kernel 2-8x the portable path at 1-64 rows,
# 1.4-1.8x at 256, even at 512.
FP8_MAX_ROWS = 256


def fp8_linear(x: Any, weight: Any, weight_scale: Any, block_k: int, threads: int) -> Any:
    """``x [..., K]`` float32 times the e4m3 ``weight [N, K]`` with per-row block scales
    ``weight_scale [N, ceil(K / block_k)]`` -> ``[..., N]``: the ``fp8_linear`` op's contract
    (`fdplug.plugin_api.ops`), read in place: the weights stay one byte each."""
    import paddle

    *lead, depth = x.shape
    cols = int(weight.shape[0])
    if list(weight.shape) != [cols, depth] or list(weight_scale.shape) != [cols, -(-depth // block_k)]:
        raise ValueError(f"fp8_linear: x [..., {depth}], weight {list(weight.shape)} and weight_scale "
                         f"{list(weight_scale.shape)} do not match block_k={block_k}")
    rows = int(np.prod(lead))
    x = _contiguous(x.reshape([rows, depth]))
    _check_float32(x, weight_scale)
    if weight.dtype != paddle.float8_e4m3fn:
        raise TypeError(f"fp8_linear needs a float8_e4m3fn weight, got {weight.dtype}")
    out = paddle.empty([rows, cols], dtype="float32")
    load().fdplug_fp8_linear(x.data_ptr(), _contiguous(weight).data_ptr(), _contiguous(weight_scale).data_ptr(),
                             out.data_ptr(), rows, cols, depth, block_k, threads)
    return out.reshape([*lead, cols])


def fp8_linear_or_portable(x: Any, weight: Any, weight_scale: Any, block_k: int, threads: int) -> Any:
    """The ``fp8_linear`` op: `fp8_linear` for float32 inputs of up to FP8_MAX_ROWS rows, else the
    portable dequantize-and-matmul (bf16/fp16 activations, long prefills)."""
    rows = int(np.prod(x.shape[:-1]))
    if rows <= FP8_MAX_ROWS and str(x.dtype) == "paddle.float32":
        return fp8_linear(x, weight, weight_scale, block_k, threads)
    from fdplug.core.portable.ops import fp8_linear as portable

    return portable(x, weight, weight_scale, block_k)


def fp8_grouped(x: Any, weight: Any, weight_scale: Any, offsets: np.ndarray, block_k: int, threads: int) -> Any:
    """Rows ``offsets[g]:offsets[g + 1]`` of ``x [A, K]`` float32 times group ``g``'s e4m3 ``weight[g]``
    ``[N, K]`` (scales ``weight_scale[g]`` ``[N, ceil(K / block_k)]``) -> ``[A, N]``: every expert of a
    MoE layer that got tokens in one call, each row computed as `fp8_linear` computes it."""
    import paddle

    groups, cols, depth = (int(d) for d in weight.shape)
    rows = int(x.shape[0])
    if list(x.shape) != [rows, depth] or list(weight_scale.shape) != [groups, cols, -(-depth // block_k)]:
        raise ValueError(f"fp8_grouped: x {list(x.shape)}, weight {list(weight.shape)} and weight_scale "
                         f"{list(weight_scale.shape)} do not match block_k={block_k}")
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if offsets.shape != (groups + 1,) or offsets[0] != 0 or offsets[-1] != rows or (np.diff(offsets) < 0).any():
        raise ValueError(f"offsets must rise from 0 to the {rows} rows over {groups} groups, got {offsets.tolist()}")
    x = _contiguous(x)
    _check_float32(x, weight_scale)
    out = paddle.empty([rows, cols], dtype="float32")
    status = load().fdplug_fp8_grouped(x.data_ptr(), _contiguous(weight).data_ptr(),
                                       _contiguous(weight_scale).data_ptr(), out.data_ptr(), offsets.ctypes.data,
                                       groups, cols, depth, block_k, threads)
    if status != 0:
        raise MemoryError("the cpu FP8 grouped linear could not allocate its work list")
    return out
