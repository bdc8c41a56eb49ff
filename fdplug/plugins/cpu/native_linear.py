"""``cpu_native_linear`` and ``cpu_native_bf16_linear``: the ``linear`` op on AVX-512 or AVX2 tiles,
float32 or bf16 weights packed at load (or read in place).

Each tile has an AVX2 + FMA twin (csrc/linear_packed_avx2.c, csrc/linear_avx2.c) that gives its
bits exactly, for x86-64-v3 CPUs (most cloud x86: AMD Zen 2/3); below that level selection refuses
these kernels. Which layers run them is measured at startup, per layer shape, against paddle's
matmul (`fdplug.core.worker.op_timing`). The figures below are the AVX-512 tiles' on this
machine; docs/performance.md has both levels'.

paddle's MKL runs its AVX2 kernels on AMD CPUs; ``fdplug_linear`` (csrc/linear.c) runs AVX-512
FMA tiles on the weights in the checkpoint's ``[N, K]`` layout, widening bf16 weights in registers
(exact: a bf16 is the top half of a float32). Measured on this 2-core AVX-512 machine against
paddle's float32 matmul of the same shapes (512x1024, 512x3072, 1536x512): float32 weights 1.4-1.9x
at 1 row, 1.4-1.5x at 64, 1.1-1.2x at 1,024 rows (~250 GFLOP/s against ~210); bf16 weights the
same speed where compute-bound and up to twice it where the weights' bytes bound it (decode).
Measured again on 2026-11-25 with MKL on both threads (``import paddle`` sets OMP_NUM_THREADS=1
when it is unset, which an isolated comparison inherits): MKL 155-207 GFLOP/s at 64-1,024 rows
against these tiles' ~120-140 (their 16 dot products end in horizontal sums; MKL's outer-product
tiles do not), in the model too (1,024-token float32 TTFT 692 vs 546 ms with ``paddle_linear``);
these tiles stay ahead at 1-16 rows (decode: 1.4-1.9x). Weights packed at load for outer-product
tiles would keep the batch invariance and close that gap: `prepare` does that (below).

``prepare`` (the op's `OpSpec.prepare`) packs each linear layer's weight once at load into panels
of 64 columns, k-major (csrc/linear_packed.c, layout ``cpu_panels64``): outer-product tiles, no
horizontal sums, one sequential stream a thread in decode. The AVX2 tiles' panels are 16 columns
(``cpu_panels16``: a 6 x 16 tile's weights one sequential stream, a one-row tile's four);
`panel_width` asks the loaded library, and the layout's name carries the width. Measured on this
machine (AVX-512 tiles), 2 threads,
against the in-place tiles, same run (``bench/linear.py --kernels``): float32 ~205-220 against
~90-140 GFLOP/s at 64-1,024 rows (above MKL's 155-207), bf16 math ~390-410 against ~300-380; one
row 1.3-2x. Each output is one FMA chain over k in order, so batch invariance holds as before;
the bits differ from the in-place tiles' (another summation order), so a layer is either packed
or not for the engine's life. The tied lm_head (the embedding table) and layers whose N is not a
multiple of 16 stay ``[N, K]`` on the in-place tiles.

``cpu_native_bf16_linear`` computes bf16 weights in bf16 math where the CPU has AVX512-BF16
(csrc/linear_bf16.c: ``x`` rounded to bf16 once a call, vdpbf16ps, float32 sums): twice the
multiply-adds an instruction, 1.9-2.2x ``cpu_native_linear``'s widened bf16 weights at 64 to 1,024
rows on this machine. Float32 weights it runs exactly as ``cpu_native_linear``. Where the build
has AMX-BF16 (``-march=native`` on such a CPU; ``FDPLUG_CPU_AMX=0`` builds without), the packed bf16
math runs on AMX tiles instead, every call of the process (csrc/linear_amx.c: other bits than
vdpbf16ps's, batch-invariant as they are): on two cores of an Intel(R) Xeon(R) Processor, avx512
with AMX (2026-12-01), 860-1,250 GFLOP/s at 256 rows against ~205-220, so the startup timing keeps
the kernel where paddle's matmul had won every shape from 256 rows.
"""

from __future__ import annotations

import functools
from typing import Any

from fdplug.plugin_api.ops import PreparedWeight
from fdplug.plugins.cpu.kernels import _contiguous, _rows, empty_f32, is_dtype, is_float32, load, paddle_parts

PANELS = "cpu_panels"
"""The packed layouts' name, the panel width after it (`PreparedWeight.layout`, e.g. ``cpu_panels64``):
csrc/linear_packed.c's header describes them."""
_F32, _BF16, _BF16_MATH = 0, 1, 2    # fdplug_linear_packed's kinds


@functools.cache
def _layout_of(library: Any) -> tuple[int, str]:
    width = int(library.fdplug_linear_packed_panel())
    return width, f"{PANELS}{width}"


def panel_width() -> int:
    """The columns of a panel in the loaded library's layout: 64 (AVX-512 tiles), 16 (AVX2 tiles)."""
    return _layout_of(load())[0]


def layout() -> str:
    """The packed layout the loaded library reads (`PreparedWeight.layout`; asked ~50 times a decode
    step, so kept per library)."""
    return _layout_of(load())[1]


def _layout_width(weight: PreparedWeight) -> int:
    """A prepared weight's panel width, from its layout's name."""
    return int(weight.layout.removeprefix(PANELS))


def prepare(weight: Any) -> PreparedWeight | None:
    """``weight [N, K]`` float32 or bf16 packed for `linear` (csrc/linear_packed.c), or None where
    the layout does not apply (N not a multiple of 16, K odd with bf16, another dtype)."""
    import paddle

    if len(weight.shape) != 2 or weight.dtype not in (paddle.float32, paddle.bfloat16, paddle.uint8):
        return None
    n, k = weight.shape
    pairs = weight.dtype == paddle.bfloat16   # uint8: e4m3 bytes (native_fp8.prepare), laid out as float32
    if n == 0 or k == 0 or n % 16 or (pairs and k % 2):
        return None
    panels, panel = [], panel_width()
    for start in range(0, n, panel):
        width = min(panel, n - start)
        block = weight[start:start + width]
        block = (block.reshape([width, k // 2, 2]).transpose([1, 0, 2]) if pairs
                 else block.transpose([1, 0]))
        panels.append(block.flatten())
    return PreparedWeight(paddle.concat(panels) if len(panels) > 1 else panels[0], (n, k), f"{PANELS}{panel}")


def unpack(weight: PreparedWeight) -> Any:
    """The ``[N, K]`` tensor of a `prepare`d weight (the portable fallback's input)."""
    import paddle

    n, k = weight.shape
    pairs = weight.dtype == paddle.bfloat16
    rows, panel = [], _layout_width(weight)
    for start in range(0, n, panel):
        width = min(panel, n - start)
        block = weight.data[start * k:(start + width) * k]
        rows.append(block.reshape([k // 2, width, 2]).transpose([1, 0, 2]).reshape([width, k]) if pairs
                    else block.reshape([k, width]).transpose([1, 0]))
    return paddle.concat(rows) if len(rows) > 1 else rows[0]


def bias_pointer(weight: PreparedWeight) -> int | None:
    """The address of the layer's float32 bias ``[N]`` the packed kernels add (None: no bias)."""
    bias = weight.bias
    if bias is None:
        return None
    if not is_float32(bias) or list(bias.shape) != [weight.shape[0]]:
        raise TypeError(f"the cpu kernels add a float32 bias of [{weight.shape[0]}],"
                        f" got {list(bias.shape)} {bias.dtype}")
    return _contiguous(bias).data_ptr()


def packed_kind(weight: PreparedWeight, bf16_math: bool) -> int:
    """fdplug_linear_packed's kind for a weight `prepare` packed: float32, or bf16 in float32 or (with
    ``bf16_math``) bf16 math. The layer's call and the decoder stack's take it from here."""
    parts, wdtype = paddle_parts(), weight.data.dtype
    if weight.layout != layout():
        raise ValueError(f"cpu_native_linear reads weights prepared as {layout()!r}, got {weight.layout!r}")
    if is_dtype(wdtype, parts.float32):
        return _F32
    if is_dtype(wdtype, parts.bfloat16):
        return _BF16_MATH if bf16_math else _BF16
    raise ValueError(f"cpu_native_linear reads float32 or bf16 weights prepared as {layout()!r}, got {wdtype}")


def _linear_packed(x: Any, weight: PreparedWeight, threads: int, bf16_math: bool) -> Any:
    kind = packed_kind(weight, bf16_math)
    shape = x.shape
    cols, depth = weight.shape
    if shape[-1] != depth:
        raise ValueError(f"linear: x [..., {shape[-1]}] and the prepared weight [{cols}, {depth}] do not match")
    if not is_float32(x):
        raise TypeError(f"the cpu kernels compute in float32, got {x.dtype}")
    rows, x = _rows(shape), _contiguous(x)
    out = empty_f32([rows, cols])
    status = load().fdplug_linear_packed(x.data_ptr(), weight.data.data_ptr(), kind, bias_pointer(weight),
                                         out.data_ptr(), rows, cols, depth, threads)
    if status != 0:
        raise MemoryError(f"cpu_native_bf16_linear: no memory for the bf16 copy of a [{rows}, {depth}] input"
                          if status == -1 else f"cpu_native_linear: packed kernel refused [{rows}, {depth}] x "
                          f"[{cols}, {depth}] ({status})")
    return out if len(shape) == 2 else out.reshape([*shape[:-1], cols])


def linear(x: Any, weight: Any, threads: int, bf16_math: bool = False) -> Any:
    """``x [..., K]`` float32 times ``weight [N, K]`` (float32 or bfloat16) -> ``[..., N]`` float32:
    the ``linear`` op's contract (`fdplug.plugin_api.ops`), the weights read in place. ``bf16_math``
    with bf16 weights: ``x`` rounded to bf16 first (`bf16_math_available` must hold).

    Called ~50 times a decode step: the checks are plain attribute reads and dtype identities
    (`is_dtype`; this wrapper took ~23 us a call, as long as the kernel on a 512 x 512 layer, before
    it stopped using numpy and reshapes; the packed path 28 -> ~23 us at one row of 576 x 576 once
    its dtype checks went by identity, AMD EPYC, avx2-or-less)."""
    if isinstance(weight, PreparedWeight):
        return _linear_packed(x, weight, threads, bf16_math)
    parts = paddle_parts()
    shape, wshape = x.shape, weight.shape
    depth = shape[-1]
    if len(wshape) != 2 or wshape[1] != depth:
        raise ValueError(f"linear: x [..., {depth}] and weight {list(wshape)} do not match ([N, {depth}])")
    wdtype = weight.dtype
    is_f32 = is_dtype(wdtype, parts.float32)
    if not is_f32 and not is_dtype(wdtype, parts.bfloat16):
        raise TypeError(f"the cpu linear kernel reads float32 or bfloat16 weights, got {wdtype}")
    if not is_float32(x):
        raise TypeError(f"the cpu kernels compute in float32, got {x.dtype}")
    rows, cols = _rows(shape), wshape[0]
    x, weight = _contiguous(x), _contiguous(weight)
    out = empty_f32([rows, cols])
    if bf16_math and not is_f32:
        if load().fdplug_linear_bf16dot(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, cols, depth,
                                        threads) != 0:
            raise MemoryError(f"cpu_native_bf16_linear: no memory for the bf16 copy of a [{rows}, {depth}] input")
    else:
        load().fdplug_linear(x.data_ptr(), weight.data_ptr(), int(is_f32), out.data_ptr(), rows, cols, depth,
                             threads)
    return out if len(shape) == 2 else out.reshape([*shape[:-1], cols])


def bf16_math_available() -> bool:
    """Whether the build has the AVX512-BF16 kernel (the CPU has the instructions, the compiler knows them)."""
    return bool(load().fdplug_linear_bf16dot_available())


def linear_or_portable(x: Any, weight: Any, threads: int, bf16_math: bool = False) -> Any:
    """The ``linear`` op: `linear` for float32 activations, else (activations in another dtype) the
    portable matmul."""
    parts, wdtype = paddle_parts(), weight.dtype
    if is_float32(x) and (is_dtype(wdtype, parts.float32) or is_dtype(wdtype, parts.bfloat16)):
        return linear(x, weight, threads, bf16_math)
    from fdplug.core.portable.ops import linear as portable

    if not isinstance(weight, PreparedWeight):
        return portable(x, weight)
    out = portable(x, unpack(weight))
    return out if weight.bias is None else out + weight.bias.astype(out.dtype)
