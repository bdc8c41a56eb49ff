"""``cpu_native_gguf_packed_linear``: GGUF linears in packed q8 math (csrc/gguf_packed.c; chosen first
where the build has AVX512-VNNI or AVX-VNNI and at x86-64-v3 without it; by name at AVX-512 without VNNI).

At load each layer's GGML blocks are repacked into groups of 16 columns (`prepare`: the same bytes,
another order, so the layer still holds the file's size); every call quantizes ``x`` to 8 bits with
a scale per run of 16 values (`fdplug.plugin_api.gguf_formats.q8_inputs` with ``run=16``) and the
tiles sum each run's products as integers with the 16 columns in a register's lanes (vpdpbusd).
Why: on a Zen 4 at AVX-512 the bf16 tiles sit near vdpbf16ps's peak from 64 rows and a decode row
pays ~9 vector operations to widen every 32 weights, where vpdpbusd does twice the multiply-adds
at twice the rate and a packed group streams in order (numbers in the C file's header and
docs/cpu-kernels.md). One summation order for every row count and thread count: a token's result
does not depend on its batch.

A weight the loader did not pack (a row count not a multiple of 16; every layer with
FDPLUG_CPU_PACK_WEIGHTS=0) runs the same tiles, each group of 16 rows packed as a call reaches it
(the same bits, slower); F16/BF16 rows, which have no integers to keep, run `native_gguf`'s float32
math. A packed weight reads its rows back (`PreparedWeight.rows`: `packed_rows`, the file's values
bit for bit), so a tied lm_head's packed table is the model's only copy of it: the embedding reads
its token rows there (`DecoderForCausalLM.prepare_tied_head`), where keeping the file's table beside
it had held that table twice (SmolLM2 Q4_K_M: 30 MB more than the file's 105 MB).
"""
from __future__ import annotations

from functools import partial
from typing import Any

from fdplug.plugin_api.ops import PreparedWeight
from fdplug.plugins.cpu import native_gguf
from fdplug.plugins.cpu.kernels import _contiguous, _rows, empty_f32, is_float32, load

LAYOUT = "gguf_groups16"
"""`PreparedWeight.layout` of a packed weight (csrc/gguf_packed.c's group layout)."""
GROUP = 16
"""Columns a group: a packed layer's row count is a multiple of it."""
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def available() -> bool:
    """Whether the build has the packed tiles (x86-64-v3 and above, not capped below by FDPLUG_CPU_ISA)."""
    return bool(load().fdplug_gguf_packed_available())


def vnni() -> bool:
    """Whether they multiply with vpdpbusd (the build has AVX512-VNNI or AVX-VNNI; without it
    vpmaddubsw, its int16 pair sums added as int16 where they cannot overflow)."""
    return bool(load().fdplug_gguf_packed_vnni())


def prepare(weight: Any, qtype: str) -> PreparedWeight | None:
    """``weight [N, row_bytes]`` (a GGUF group's blocks) repacked into groups of 16 columns: a
    `PreparedWeight` of the same bytes, or None where the layout does not apply (another type, ``N``
    not a multiple of 16): that layer then runs `fallback`."""
    qtype = str(qtype).upper()
    if qtype not in TYPES or len(weight.shape) != 2 or weight.shape[0] % GROUP or not available():
        return None
    import paddle

    from fdplug.plugin_api.gguf_formats import BLOCK_FORMATS

    fmt = BLOCK_FORMATS[qtype]
    n, row_bytes = weight.shape
    k = row_bytes // fmt.nbytes * fmt.block
    out = paddle.empty([n, row_bytes], dtype="uint8")
    status = load().fdplug_gguf_pack(_contiguous(weight).data_ptr(), out.data_ptr(), n, k, fmt.ggml_type)
    if status != 0:
        raise ValueError(f"fdplug_gguf_pack refused {qtype} rows of {k} weights (status {status})")
    return PreparedWeight(out, (n, k), LAYOUT, rows=partial(packed_rows, out, qtype, n, k))


def packed_rows(data: Any, qtype: str, n: int, k: int, ids: Any) -> Any:
    """Rows ``ids`` (``[T]`` token ids, each in ``[0, n)``) of the packed ``[n, k]`` weight ``data``
    -> ``[T, k]`` float32 with the file's values (csrc/gguf_packed_rows.c: `gguf_blocks.dequantize`'s
    bits)."""
    import paddle

    ids = _contiguous((ids if isinstance(ids, paddle.Tensor) else paddle.to_tensor(ids)).astype("int64").reshape([-1]))
    out = empty_f32([int(ids.shape[0]), k])
    status = load().fdplug_gguf_packed_rows(data.data_ptr(), ids.data_ptr(), int(ids.shape[0]), out.data_ptr(), n, k,
                                            native_gguf._type_id(qtype))
    if status == -1:
        raise ValueError(f"token ids outside the table's {n} rows")
    if status != 0:
        raise ValueError(f"fdplug_gguf_packed_rows refused {qtype} rows of {k} weights (status {status})")
    return out


def gguf_linear(x: Any, weight: Any, qtype: str, k: int, threads: int) -> Any:
    """``x [..., K]`` float32 times a packed weight (logical ``[N, K]``), or the file's ``[N,
    row_bytes]`` blocks (each group of 16 rows packed as the call reaches it: the same bits) ->
    ``[..., N]`` float32."""
    packed = isinstance(weight, PreparedWeight)
    if packed and weight.layout != LAYOUT:
        raise ValueError(f"cpu_native_gguf_packed_linear reads {LAYOUT} weights, not {weight.layout}")
    if packed:
        n, depth = weight.shape
    else:
        native_gguf._check_weight(weight, qtype, k)
        n, depth = weight.shape[0], k
    shape = x.shape
    if shape[-1] != k or depth != k:
        raise ValueError(f"gguf_linear: x [..., {shape[-1]}] against packed rows of {depth} weights (k={k})")
    if not is_float32(x):
        raise TypeError(f"the cpu kernels compute in float32, got {x.dtype}")
    rows = _rows(shape)
    x = _contiguous(x if len(shape) == 2 else x.reshape([rows, k]))
    out = empty_f32([rows, n])
    data = weight.data if packed else _contiguous(weight)
    status = load().fdplug_gguf_linear_packed(x.data_ptr(), data.data_ptr(), out.data_ptr(), rows, n, k,
                                              native_gguf._type_id(qtype), int(packed), threads)
    if status == -3:
        raise MemoryError(f"gguf_linear: no memory for the quantized copy of a [{rows}, {k}] input or a group")
    if status != 0:
        raise ValueError(f"fdplug_gguf_linear_packed refused {qtype} rows of {k} weights (status {status})")
    return out if len(shape) == 2 else out.reshape([*shape[:-1], n])


def gguf_linear_or_fallback(x: Any, weight: Any, qtype: str, k: int, threads: int) -> Any:
    """The ``gguf_linear`` op: the packed tiles for float32 inputs on a weight `prepare` packed or on
    the file's rows of the types it takes (`TYPES`); F16/BF16 rows in `native_gguf`'s float32 math (no
    integers to keep: as ``OpSpec(q8_inputs=...)`` says); anything else the portable op."""
    is_f32 = is_float32(x)
    if isinstance(weight, PreparedWeight):
        if not is_f32:
            raise TypeError(f"gguf_linear: packed {qtype} weights take float32 inputs, got {x.dtype}")
        return gguf_linear(x, weight, qtype, k, threads)
    if is_f32 and str(qtype).upper() in TYPES:
        return gguf_linear(x, weight, qtype, k, threads)
    return native_gguf.gguf_linear_or_portable(x, weight, qtype, k, threads)
