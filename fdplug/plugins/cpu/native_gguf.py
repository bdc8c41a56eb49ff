"""``cpu_native_gguf_linear``: the ``gguf_linear`` op with a GGUF file's GGML blocks read in place.

The portable op (`fdplug.core.portable.ops.gguf_linear`) dequantizes the whole layer with paddle's
bitwise ops on every call, then runs one matmul: 1.3-2.3 ms a 576 x 1,536 layer (Q8_0, Q4_1), ~10 ms
a 512 x 1,536 one in Q6_K, even for a one-token decode step. ``fdplug_gguf_linear`` (csrc/gguf_linear.c) widens each
block in
registers and feeds FMAs for up to 8 rows at once (above 8 rows, each thread widens a panel of
weight rows once into an L2-sized buffer and runs the same tiles over every row), so the weights
stay 4.5-8.5 bits each in memory and are read once a call. Each weight is decoded to the portable
op's exact float32 value; only the summation order differs, and it is the same for every row
count, thread count and level (AVX-512, AVX2, scalar): a token's outputs do not depend on its
batch. Measured with ``bench/gguf_linear.py`` on this 2-core Zen 5 (AVX-512, 2 threads): 15-210x
the portable op at 1-8 rows (1 row: 16-57 GFLOP/s; the 49152 x 576 Q8_0 lm_head ~1 ms, ~30 GB/s of
blocks), 2-20x at 64-256 rows (160-195 GFLOP/s).

With AVX2 tiles (x86-64-v3) the tiles keep the AVX-512 tiles' bits (each 16-lane chain as two
ymm, 3 rows a tile) and run 57-63 GFLOP/s from 64 rows, where widening the layer and paddle's
matmul (MKL) reached 100-123: a prefill cost accepted so that a row's result never depends on
whether its batch had more than some number of rows (a decode step and a recompute agree).

``cpu_native_gguf_bf16_linear`` (``bf16_math=True``, where the build has AVX512-BF16) runs the same
tiles in bf16 math (csrc/gguf_linear_bf16.c): x and each decoded weight rounded to bf16, the exact
products summed in float32 by ``vdpbf16ps``, one summation order for every row count again. Measured
on this Zen 5 (AVX-512, 2 threads, ``bench/gguf_linear.py``): 1.4-1.9x the float32 tiles from 64
rows, 0.92-0.93x at one row (the rounding of each decoded weight costs a conversion there): prefill
and batched decode gain, single-stream decode pays ~8%.

``cpu_native_gguf_q8_linear`` (``q8_math=True``, where the build has AVX2; chosen first at x86-64-v3) runs in
q8 math (csrc/gguf_q8.c), as llama.cpp does: ``x`` quantized to 8 bits per 4 values
(`fdplug.plugin_api.gguf_formats.q8_inputs`), each 32 weights' products summed as integers with
``vpmaddubsw``, the blocks never widened to floats; one summation order again. Measured at AVX2
(AMD EPYC, avx512, capped; 2 threads): 1.4-1.9x the float32 tiles at 1-8 rows, 0.8-1.3x from 64; at
AVX-512 (two pieces a 512-bit register, the same bits) 1.2-1.5x the bf16 tiles at one row, 0.55-0.7x
from 64.
SmolLM2-135M's perplexity +0.09% (bf16 math +0.11%); two of the fixture's five greedy
continuations leave transformers' tokens at near ties (tests/test_smollm2.py). At AVX-512, where bf16
math is faster from a few rows, it runs where it is named.

Types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (`SUPPORTED`). The op gets its block type per
call, and one GGUF file mixes types (Q4_K_M: Q4_K, Q6_K, Q8_0...), so another type (F16, BF16,
F32, or one gguf_blocks may learn later) does not refuse the kernel for the whole model at
selection: that call runs the portable op, as do activations other than float32.
"""
from __future__ import annotations

from typing import Any

from fdplug.plugin_api.gguf_formats import BLOCK_FORMATS
from fdplug.plugin_api.gguf_formats import row_bytes as gguf_row_bytes
from fdplug.plugin_api.ops import PreparedWeight
from fdplug.plugins.cpu.kernels import _contiguous, _rows, empty_f32, is_dtype, is_float32, load, paddle_parts

SUPPORTED: tuple[str, ...] = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")
"""The block types csrc/gguf_linear.c decodes (float16 and bfloat16 rows in runs of 4 values)."""
HALF_RUN = 32
"""csrc/gguf_linear.c reads F16 and BF16 rows 32 values at a time: their rows' length is a multiple."""
_HALVES = ("F16", "BF16")
_IDS = {name: BLOCK_FORMATS[name].ggml_type for name in SUPPORTED}   # the C code takes ggml's ids


def _type_id(qtype: str) -> int:
    type_id = _IDS.get(str(qtype).upper())
    if type_id is None:
        raise ValueError(f"cpu_native_gguf_linear decodes {', '.join(SUPPORTED)}, not {qtype!r}")
    return type_id


def takes(qtype: str, k: int) -> bool:
    """Whether the kernel reads rows of ``k`` weights of ``qtype`` (the others run the portable op)."""
    return qtype in _IDS and (qtype not in _HALVES or k % HALF_RUN == 0)


def _check_weight(weight: Any, qtype: str, k: int) -> int:
    """The row bytes of ``weight [N, row_bytes]`` for ``k`` weights of ``qtype`` a row (raises if not)."""
    fmt = BLOCK_FORMATS[str(qtype).upper()]
    if fmt.name in _HALVES and k % HALF_RUN:
        raise ValueError(f"{fmt.name} rows are read in runs of {HALF_RUN} weights here, not {k}")
    row_bytes = gguf_row_bytes(fmt, k)     # (raises for k not a positive multiple of the block)
    shape = weight.shape
    if not is_dtype(weight.dtype, paddle_parts().uint8) or len(shape) != 2 or shape[1] != row_bytes:
        raise ValueError(f"gguf_linear: {fmt.name} rows of {k} weights are uint8 [N, {row_bytes}]; got "
                         f"{weight.dtype} {list(shape)}")
    return row_bytes


def bf16_math_available() -> bool:
    """Whether the build has the bf16-math tiles (csrc/gguf_linear_bf16.c: the CPU has AVX512-BF16,
    the compiler knows it, and FDPLUG_CPU_ISA does not cap it away)."""
    return bool(load().fdplug_gguf_bf16_available())


def q8_math_available() -> bool:
    """Whether the build has the q8-math tiles (csrc/gguf_q8.c: AVX2, not capped away)."""
    return bool(load().fdplug_gguf_q8_available())


def gguf_linear(x: Any, weight: Any, qtype: str, k: int, threads: int, bf16_math: bool = False,
                q8_math: bool = False) -> Any:
    """``x [..., K]`` float32 times ``weight [N, row_bytes]`` uint8 (rows of ``K == k`` weights in
    GGML blocks of ``qtype``, byte for byte as in the file) -> ``[..., N]`` float32: the
    ``gguf_linear`` op's contract (`fdplug.plugin_api.ops`), for the types in `SUPPORTED` only.
    ``bf16_math``: ``x`` and the decoded weights rounded to bf16, float32 sums (AVX512-BF16).
    ``q8_math``: ``x`` quantized to 8 bits per 4 values, integer sums per 32 weights (AVX2; F16
    and BF16 rows in float32 math)."""
    type_id = _type_id(qtype)
    _check_weight(weight, qtype, k)
    shape = x.shape
    if shape[-1] != k:
        raise ValueError(f"gguf_linear: x [..., {shape[-1]}] against rows of {k} weights")
    if not is_float32(x):
        raise TypeError(f"the cpu kernels compute in float32, got {x.dtype}")
    rows, cols = _rows(shape), weight.shape[0]
    x = _contiguous(x if len(shape) == 2 else x.reshape([rows, k]))
    out = empty_f32([rows, cols])
    lib = load()
    run = lib.fdplug_gguf_linear_q8 if q8_math else lib.fdplug_gguf_linear_bf16 if bf16_math else lib.fdplug_gguf_linear
    status = run(x.data_ptr(), _contiguous(weight).data_ptr(), out.data_ptr(), rows, cols, k, type_id, threads)
    if status == -3:
        raise MemoryError(f"gguf_linear: no memory for the {'q8' if q8_math else 'bf16'} copy of a [{rows}, {k}] input")
    if status != 0:
        raise ValueError(f"fdplug_gguf_linear refused {qtype} rows of {k} weights (status {status})")
    return out if len(shape) == 2 else out.reshape([*shape[:-1], cols])


def dequantize(weight: Any, qtype: str, k: int, threads: int) -> Any:
    """``weight [N, row_bytes]`` -> float32 ``[N, k]``: the values the kernel multiplies, widened by
    its own decoders (the tests hold them to `gguf_blocks.dequantize`'s bits)."""
    type_id = _type_id(qtype)
    _check_weight(weight, qtype, k)
    out = empty_f32([weight.shape[0], k])
    status = load().fdplug_gguf_dequant(_contiguous(weight).data_ptr(), out.data_ptr(), weight.shape[0], k, type_id,
                                        threads)
    if status != 0:
        raise ValueError(f"fdplug_gguf_dequant refused {qtype} rows of {k} weights (status {status})")
    return out


def gguf_linear_or_portable(x: Any, weight: Any, qtype: str, k: int, threads: int, bf16_math: bool = False,
                            q8_math: bool = False) -> Any:
    """The ``gguf_linear`` op: `gguf_linear` for float32 inputs and the types in `SUPPORTED` on the
    file's ``[N, row_bytes]`` bytes, at every row count (one summation order: a row's result does
    not depend on its batch); anything else the portable dequantize-and-matmul."""
    if takes(qtype, k) and is_float32(x) and not isinstance(weight, PreparedWeight):
        return gguf_linear(x, weight, qtype, k, threads, bf16_math, q8_math)
    from fdplug.core.portable.ops import gguf_linear as portable

    return portable(x, weight, qtype, k)
