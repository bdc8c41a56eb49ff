"""The cpu plugin's ``rms_norm``, ``add_rms_norm`` and ``rope`` ops: one compiled call each
(csrc/rms_norm.c), float32; anything else (another dtype, a shape the kernel does not take) goes to
the portable op.

Why: in a decode step every small op runs with caches the weights just streamed through (~100 MB a
step for the bench model): measured here, an RMSNorm call that takes 15 us on its own took ~30 us
between linears, paddle's add ~15-30 us. Fewer calls is what helps, so the residual add runs inside
the norm and RoPE's four Paddle ops are one call. The wrappers read shapes as lists, no numpy.
"""

from __future__ import annotations

from typing import Any

from fdplug.plugins.cpu.kernels import _contiguous, _rows, empty_f32, is_float32, load

# Below this many rows one thread does the norm: starting the others costs more than it saves.
RMS_NORM_MIN_PARALLEL_ROWS = 64


def _norm_threads(rows: int, threads: int) -> int:
    return threads if rows >= RMS_NORM_MIN_PARALLEL_ROWS else 1


def rms_norm(x: Any, weight: Any, eps: float, threads: int) -> Any:
    """The ``rms_norm`` op (`fdplug.plugin_api.ops`) in one call for float32 ``x [..., D]`` and a
    ``weight`` of ``[D]`` or of ``x``'s trailing ``[heads, D]`` (the q/k norm); else paddle's."""
    shape, wshape = x.shape, weight.shape
    dim = shape[-1]
    if (not is_float32(x) or not is_float32(weight) or dim == 0 or len(wshape) > 2
            or wshape != shape[len(shape) - len(wshape):]):
        from fdplug.core.portable.ops import rms_norm as portable

        return portable(x, weight, eps)
    x = _contiguous(x)
    rows = _rows(shape)
    out = empty_f32(shape)
    load().fdplug_rms_norm(x.data_ptr(), _contiguous(weight).data_ptr(), out.data_ptr(), rows, dim,
                           1 if len(wshape) == 1 else wshape[0], eps, _norm_threads(rows, threads))
    return out


def add_rms_norm(x: Any, residual: Any, weight: Any, eps: float, threads: int) -> tuple[Any, Any]:
    """The ``add_rms_norm`` op: ``(rms_norm(x + residual), x + residual)`` in one call for float32
    ``x``, ``residual`` of one shape ``[..., D]`` and ``weight [D]``; else the portable op."""
    shape = x.shape
    dim = shape[-1]
    if (not is_float32(x) or not is_float32(residual) or not is_float32(weight)
            or dim == 0 or residual.shape != shape or weight.shape != [dim]):
        from fdplug.core.portable.ops import add_rms_norm as portable

        return portable(x, residual, weight, eps)
    x, residual = _contiguous(x), _contiguous(residual)
    rows = _rows(shape)
    total, out = empty_f32(shape), empty_f32(shape)
    load().fdplug_add_rms_norm(x.data_ptr(), residual.data_ptr(), _contiguous(weight).data_ptr(), total.data_ptr(),
                               out.data_ptr(), rows, dim, eps, _norm_threads(rows, threads))
    return out, total


# Rows of [T, heads, D] below which one thread rotates them (a decode step's few tokens).
ROPE_MIN_PARALLEL_ROWS = 512


def rope(x: Any, cos: Any, sin: Any, threads: int) -> Any:
    """The ``rope`` op in one call for float32 ``x``, ``cos``, ``sin`` of one shape ``[..., D]``
    with ``D`` even; else the portable op."""
    shape = x.shape
    dim = shape[-1]
    if (not is_float32(x) or not is_float32(cos) or not is_float32(sin)
            or dim % 2 or cos.shape != shape or sin.shape != shape):
        from fdplug.core.portable.ops import rope as portable

        return portable(x, cos, sin)
    x, cos, sin = _contiguous(x), _contiguous(cos), _contiguous(sin)
    rows = _rows(shape)
    out = empty_f32(shape)
    load().fdplug_rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), rows, dim,
                       threads if rows >= ROPE_MIN_PARALLEL_ROWS else 1)
    return out
