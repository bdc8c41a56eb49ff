"""``cpu_native_bf16_linear``: the ``bf16_linear`` op with bf16 weights read in place.

The portable op widens a whole layer to float32 per call and runs paddle's float32 matmul: as fast
as float32 weights at best, never faster. ``fdplug_bf16_linear`` (csrc/bf16_linear.c) widens 16
weights at a time in registers (exact: a bf16 is the top half of a float32) and feeds FMAs for a
tile of rows: the weights stay two bytes in memory and are read once per call, so a decode step,
which streams every weight, reads half the bytes of float32. The math is float32's.

It runs at every row count: measured on this 2-core AVX-512 machine against paddle's float32
matmul of the same shapes (whose MKL takes its AVX2 path on AMD), 1.2-2.1x at 1 row, 1.4-4.8x at 8,
1.3-1.4x at 1,024 rows (~300 GFLOP/s against ~200).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fdplug.plugins.cpu.kernels import _check_float32, _contiguous, load

def bf16_linear(x: Any, weight: Any, threads: int) -> Any:
    """``x [..., K]`` float32 times the bf16 ``weight [N, K]`` -> ``[..., N]`` float32: the
    ``bf16_linear`` op's contract (`fdplug.plugin_api.ops`), the weights read in place."""
    import paddle

    *lead, depth = x.shape
    cols = int(weight.shape[0])
    if len(weight.shape) != 2 or int(weight.shape[1]) != depth:
        raise ValueError(f"bf16_linear: x [..., {depth}] and weight {list(weight.shape)} do not match ([N, {depth}])")
    if weight.dtype != paddle.bfloat16:
        raise TypeError(f"bf16_linear needs a bfloat16 weight, got {weight.dtype}")
    rows = int(np.prod(lead))
    x = _contiguous(x.reshape([rows, depth]))
    _check_float32(x)
    out = paddle.empty([rows, cols], dtype="float32")
    load().fdplug_bf16_linear(x.data_ptr(), _contiguous(weight).data_ptr(), out.data_ptr(), rows, cols, depth, threads)
    return out.reshape([*lead, cols])


def bf16_linear_or_portable(x: Any, weight: Any, threads: int) -> Any:
    """The ``bf16_linear`` op: `bf16_linear` for float32 inputs, else (bf16/fp16 activations on a
    device that computes in them) the portable widen-and-matmul."""
    if str(x.dtype) == "paddle.float32":
        return bf16_linear(x, weight, threads)
    from fdplug.core.portable.ops import bf16_linear as portable

    return portable(x, weight)
