"""``cpu_native_fp8_linear``: the ``fp8_linear`` op with FP8 weights read in place.

The portable op dequantizes a whole layer per call: paddle's CPU casts from float8 are scalar, so a
4096x1024 layer took 25-30 ms to widen before a 0.4 ms GEMV. ``fdplug_fp8_linear`` (csrc) widens
each 16 weights in registers and feeds them to FMAs for up to 8 rows: the weights stay one byte in
memory and are read once per call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fdplug.plugin_api.ops import PreparedWeight
from fdplug.plugins.cpu import native_linear
from fdplug.plugins.cpu.kernels import (
    _check_float32,
    _contiguous,
    _rows,
    empty_f32,
    is_dtype,
    is_float32,
    load,
    paddle_parts,
)

# Up to this many rows the weights are widened in registers; above, one dequantized copy of the
# layer and paddle's GEMM catch up (the widening is repeated for every 8 rows). Measured on this
# 2-core machine, 1536x512 and 4096x1024 layers: the kernel 2-8x the portable path at 1-64 rows,
# 1.4-1.8x at 256, even at 512.
FP8_MAX_ROWS = 256


def prepare(weight: Any) -> PreparedWeight | None:
    """An e4m3 ``weight [N, K]`` packed once at load into native_linear's panels (one byte a weight
    still, csrc/linear_packed.c), for `fp8_linear`'s outer-product tiles; None where N is not a
    multiple of 16 (that layer keeps the row-major kernels)."""
    import paddle

    if len(weight.shape) != 2 or weight.dtype != paddle.float8_e4m3fn:
        return None
    n, k = weight.shape
    if n == 0 or k == 0 or n % 16:
        return None
    packed = native_linear.prepare(weight.view(paddle.uint8))
    return PreparedWeight(packed.data.view(paddle.float8_e4m3fn), (n, k), packed.layout)


def _fp8_linear_packed(x: Any, weight: PreparedWeight, weight_scale: Any, block_k: int, threads: int) -> Any:
    cols, depth = weight.shape
    shape, sshape = x.shape, weight_scale.shape
    if weight.layout != native_linear.layout() or not is_dtype(weight.dtype, paddle_parts().float8_e4m3fn):
        raise ValueError(f"cpu_native_fp8_linear reads e4m3 weights prepared as {native_linear.layout()!r}, got "
                         f"{weight.layout!r} ({weight.dtype})")
    if shape[-1] != depth or block_k <= 0 or list(sshape) != [cols, -(-depth // block_k)]:
        raise ValueError(f"fp8_linear: x [..., {shape[-1]}], the prepared weight [{cols}, {depth}] and "
                         f"weight_scale {list(sshape)} do not match block_k={block_k}")
    rows = _rows(shape)
    x = _contiguous(x if len(shape) == 2 else x.reshape([rows, depth]))
    _check_float32(x, weight_scale)
    out = empty_f32([rows, cols])
    status = load().fdplug_linear_packed_fp8(x.data_ptr(), weight.data.data_ptr(), _contiguous(weight_scale).data_ptr(),
                                             native_linear.bias_pointer(weight), out.data_ptr(), rows, cols, depth,
                                             block_k, threads)
    if status != 0:
        raise MemoryError(f"cpu_native_fp8_linear: no memory for the transposed scales of a [{cols}, {depth}] layer")
    return out if len(shape) == 2 else out.reshape([*shape[:-1], cols])


def fp8_linear(x: Any, weight: Any, weight_scale: Any, block_k: int, threads: int) -> Any:
    """``x [..., K]`` float32 times the e4m3 ``weight [N, K]`` with per-row block scales
    ``weight_scale [N, ceil(K / block_k)]`` -> ``[..., N]``: the ``fp8_linear`` op's contract
    (`fdplug.plugin_api.ops`), read in place: the weights stay one byte each (a `prepare`d weight:
    the packed tiles, whatever the row count)."""
    if isinstance(weight, PreparedWeight):
        return _fp8_linear_packed(x, weight, weight_scale, block_k, threads)
    shape, wshape, sshape = x.shape, weight.shape, weight_scale.shape
    depth, cols = shape[-1], wshape[0]
    if depth <= 0 or block_k <= 0 or wshape != [cols, depth] or sshape != [cols, -(-depth // block_k)]:
        raise ValueError(f"fp8_linear: x [..., {depth}], weight {wshape} and weight_scale {sshape} do not "
                         f"match block_k={block_k}")
    rows = _rows(shape)
    x = _contiguous(x if len(shape) == 2 else x.reshape([rows, depth]))
    _check_float32(x, weight_scale)
    if not is_dtype(weight.dtype, paddle_parts().float8_e4m3fn):
        raise TypeError(f"fp8_linear needs a float8_e4m3fn weight, got {weight.dtype}")
    out = empty_f32([rows, cols])
    load().fdplug_fp8_linear(x.data_ptr(), _contiguous(weight).data_ptr(), _contiguous(weight_scale).data_ptr(),
                             out.data_ptr(), rows, cols, depth, block_k, threads)
    return out if len(shape) == 2 else out.reshape([*shape[:-1], cols])


def dequantize(weight: Any, weight_scale: Any, block_k: int, threads: int) -> Any:
    """The e4m3 ``weight [N, K]`` times its per-row block scales as float32 ``[N, K]``, in one compiled
    pass (paddle's float8 casts are scalar: 25-30 ms for a 4096x1024 layer)."""
    import paddle

    cols, depth = (int(d) for d in weight.shape)
    if weight.dtype != paddle.float8_e4m3fn or list(weight_scale.shape) != [cols, -(-depth // block_k)]:
        raise ValueError(f"dequantize: weight {list(weight.shape)} ({weight.dtype}) and weight_scale "
                         f"{list(weight_scale.shape)} do not match block_k={block_k}")
    _check_float32(weight_scale)
    out = empty_f32([cols, depth])
    load().fdplug_fp8_dequant(_contiguous(weight).data_ptr(), _contiguous(weight_scale).data_ptr(), out.data_ptr(),
                              cols, depth, block_k, threads)
    return out


def fp8_linear_or_portable(x: Any, weight: Any, weight_scale: Any, block_k: int, threads: int) -> Any:
    """The ``fp8_linear`` op: `fp8_linear` for float32 inputs of up to FP8_MAX_ROWS rows; for longer
    float32 inputs (prefill) the layer widened once in C and the linear kernel's tiles; else (bf16/fp16
    activations) the portable dequantize-and-matmul."""
    rows = _rows(x.shape)
    if is_float32(x):
        if rows <= FP8_MAX_ROWS or isinstance(weight, PreparedWeight):
            return fp8_linear(x, weight, weight_scale, block_k, threads)
        from fdplug.plugins.cpu.native_linear import linear

        return linear(x, dequantize(weight, weight_scale, block_k, threads), threads)
    import paddle

    from fdplug.core.portable.ops import fp8_linear as portable

    if not isinstance(weight, PreparedWeight):
        return portable(x, weight, weight_scale, block_k)
    unpacked = native_linear.unpack(PreparedWeight(weight.data.view(paddle.uint8), weight.shape, weight.layout))
    out = portable(x, unpacked.view(paddle.float8_e4m3fn), weight_scale, block_k)
    return out if weight.bias is None else out + weight.bias.astype(out.dtype)



def fp8_moe(x: Any, experts: Any, topk_ids: np.ndarray, topk_weights: np.ndarray, threads: int) -> Any:
    """``out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t)``, ``e = topk_ids[t, k]``,
    for ``x [T, H]`` float32 and FP8 experts (`native_moe.Fp8Experts`), read in place: one call
    sorts the assignments by expert, runs both grouped GEMMs (every expert that got tokens shares
    the threads) and sums each token's rows in k order."""

    x = _contiguous(x)
    _check_float32(x, experts.s13, experts.s2)
    count, double_inter, hidden = (int(d) for d in experts.w13.shape)
    tokens = int(x.shape[0])
    ids = np.ascontiguousarray(topk_ids, dtype=np.int32)
    weights = np.ascontiguousarray(topk_weights, dtype=np.float32)
    if list(x.shape) != [tokens, hidden] or ids.ndim != 2 or ids.shape[0] != tokens or weights.shape != ids.shape:
        raise ValueError(f"fp8_moe: x {list(x.shape)}, topk_ids {ids.shape} and topk_weights {weights.shape} "
                         f"do not fit experts of hidden size {hidden}")
    out = empty_f32([tokens, hidden])
    if tokens == 0:
        return out
    status = load().fdplug_fp8_moe(
        x.data_ptr(), _contiguous(experts.w13).data_ptr(), _contiguous(experts.s13).data_ptr(),
        _contiguous(experts.w2).data_ptr(), _contiguous(experts.s2).data_ptr(), ids.ctypes.data, weights.ctypes.data,
        out.data_ptr(), tokens, ids.shape[1], count, hidden, double_inter // 2, experts.block_k, threads)
    if status == -2:
        bad = ids[(ids < 0) | (ids >= count)]
        raise ValueError(f"expert id {int(bad[0])} is outside [0, {count})")
    if status != 0:
        raise MemoryError("the cpu FP8 MoE kernel could not allocate its scratch memory")
    return out
