"""GGML's block formats (the weights of a GGUF file), dequantized with plain Paddle ops.

This is the portable path: every device that runs Paddle runs it, and it runs on every forward pass
(the linear weights stay quantized in memory and are expanded just before their matmul), so each
format is a handful of whole-tensor ops over ``[rows, blocks, bytes]``, never a Python loop over
rows or blocks.

A row of ``k`` weights is ``k / block`` blocks of ``nbytes`` bytes; each block holds float16 scales
and packed integers. The layouts and the arithmetic follow ggml's reference ``dequantize_row_*``
(ggml/src/ggml-quants.c) as ported to numpy by ``gguf.quants`` (the gguf package), and the results
are the same bit for bit. That is possible on any IEEE device because nearly every product here is
exact in float32: a float16 scale has 11 significant bits and the integers at most 8, so
``d * q`` (Q4_0, Q5_0, Q8_0, Q4_1, Q5_1), ``d * sc``, ``d * sc * q`` (Q4_K, Q5_K: 11 + 6 + 5 bits)
lose nothing, and the only rounding is the final ``+ m`` / ``- dmin * m`` (so a C build of ggml that
contracts it into an FMA gets the same bits too). Q6_K is the exception: ``(d * sc) * q`` needs 25
bits, so it is computed in ggml's order, ``d * sc`` first.

Two Paddle 3.3 pitfalls are worked around here: ``Tensor.view(dtype)`` ignores the storage offset
of a contiguous view (``raw[3:5]`` reinterprets the bytes of ``raw[0:2]``), so every byte view goes
through `_bytes_as`, which copies such a tensor first; and the CPU float32 -> float16 cast is wrong
for tiny values (see `dequantize`).

The table of formats (names, ids, sizes) is the contract's `fdplug.plugin_api.gguf_formats`.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import Any

import numpy as np
import paddle

from fdplug.plugin_api.gguf_formats import (  # noqa: F401
    BLOCK_FORMATS,
    QK_K,
    BlockFormat,
    _resolve,
    format_of,
    row_bytes,
)

# The table is the contract's (no Paddle there); imported here for the callers of this module.
# --- helpers ------------------------------------------------------------------------------------
#
# The packed integers are unpacked four bytes at a time: a field's bytes are viewed as int32 words
# and masked with byte-repeated masks (``(w >> 4) & 0x0F0F0F0F`` is every byte's high nibble), then
# viewed back as bytes. Masking per byte makes this independent of byte order and of the bits a
# shift drags in from the neighbouring byte. It is also 4x fewer elements, which matters on CPU,
# where paddle's uint8 shifts and broadcast bitwise ops run at about a nanosecond per element.

_CONSTS: dict[tuple, paddle.Tensor] = {}
_NUMPY = {paddle.uint8: np.uint8, paddle.int32: np.int32}


def _const(values: Any, like: paddle.Tensor) -> paddle.Tensor:
    """A small tensor of ``like``'s dtype (uint8 or int32) on its device, for paddle's bitwise ops,
    which take no Python scalars; made once per device and value, as this runs every step."""
    arr = np.asarray(values, _NUMPY[like.dtype])
    key = (str(like.place), arr.dtype.str, arr.shape, arr.tobytes())
    t = _CONSTS.get(key)
    if t is None:
        t = _CONSTS[key] = paddle.to_tensor(arr, place=like.place)
    return t


def _bytes_as(t: paddle.Tensor, dtype: Any) -> paddle.Tensor:
    """``t``'s bytes reinterpreted as ``dtype``. A slice or a view with an offset is copied first:
    ``view(dtype)`` reads from the start of the storage and in memory order."""
    if not t.is_contiguous() or t.offset != 0:
        t = t.clone()
    return t.view(dtype)


def _per(scale: paddle.Tensor, values: paddle.Tensor) -> paddle.Tensor:
    """``scale`` (one per block or sub-block, trailing dim 1) expanded to ``values``' shape. Paddle's
    CPU broadcasting multiply of ``[..., 8, 1]`` by ``[..., 8, 32]`` is ~8x slower than an
    ``expand`` plus a same-shape multiply (3.1 ms vs 0.4 ms for a 576 x 1536 Q4_K weight)."""
    return scale.expand(values.shape)


def _f16(b: paddle.Tensor, at: int) -> paddle.Tensor:
    """The float16 at byte ``at`` of each block of ``b`` ``[R, B, nbytes]``, as float32 ``[R, B, 1]``."""
    return _bytes_as(b[:, :, at:at + 2], paddle.float16).astype("float32")


def _int8(b: paddle.Tensor, start: int, stop: int) -> paddle.Tensor:
    """Bytes ``[start, stop)`` of each block read as int8, as float32."""
    return _bytes_as(b[:, :, start:stop], paddle.int8).astype("float32")


def _words(b: paddle.Tensor, start: int, stop: int) -> paddle.Tensor:
    """Bytes ``[start, stop)`` of each block as int32 words ``[R, B, (stop - start) / 4]``."""
    return _bytes_as(b[:, :, start:stop], paddle.int32)


def _nibble_words(w: paddle.Tensor) -> paddle.Tensor:
    """Words ``[..., n]`` -> ``[..., 2n]``: the low nibbles of their 4n bytes, then the high ones
    (ggml's order: byte j gives element j and element j + 4n)."""
    mask = _const(0x0F0F0F0F, w)
    both = paddle.stack([w & mask, (w >> 4) & mask], axis=-2)   # 4x faster than concat on paddle's CPU
    return both.reshape([*w.shape[:-1], 2 * w.shape[-1]])


def _spread(w: paddle.Tensor, shifts: list[int], mask: int) -> paddle.Tensor:
    """Words ``[..., n]`` -> ``[..., len(shifts), n]``: ``(w >> s) & mask`` for each shift ``s``
    (a field of every byte, moved to the bottom of its byte). One op per shift on these small
    tensors beats one broadcast shift, which paddle's CPU runs element by element."""
    m = _const(mask, w)
    return paddle.stack([(w >> s) & m for s in shifts], axis=-2)


def _as_values(words: paddle.Tensor) -> paddle.Tensor:
    """int32 words of unpacked bytes -> their bytes as float32 ``[..., 4n]``."""
    return words.view(paddle.uint8).astype("float32")


def _k_scales(s: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml ``get_scale_min_k4``):
    bytes 0-3 hold scales 0-3 in their low 6 bits, 4-7 mins 0-3; scales/mins 4-7 take their low 4
    bits from bytes 8-11 (low/high nibble) and their top 2 bits from the top of bytes 0-3 / 4-7."""
    lo6, hi2 = _const(0x3F, s), _const(0x30, s)
    sc, mn, extra = s[:, :, 0:4], s[:, :, 4:8], s[:, :, 8:12]
    scales = paddle.concat([sc & lo6, (extra & _const(0x0F, s)) | ((sc >> 2) & hi2)], axis=-1)
    mins = paddle.concat([mn & lo6, (extra >> 4) | ((mn >> 2) & hi2)], axis=-1)
    return scales.astype("float32"), mins.astype("float32")


# --- the formats: each takes blocks [R, B, nbytes] uint8 and returns float32 in element order ---

def _q8_0(b: paddle.Tensor) -> paddle.Tensor:
    q = _int8(b, 2, 34)
    return q * _per(_f16(b, 0), q)


def _q4_0(b: paddle.Tensor) -> paddle.Tensor:
    q = _as_values(_nibble_words(_words(b, 2, 18))) - 8.0
    return q * _per(_f16(b, 0), q)


def _q4_1(b: paddle.Tensor) -> paddle.Tensor:
    q = _as_values(_nibble_words(_words(b, 4, 20)))
    return q * _per(_f16(b, 0), q) + _per(_f16(b, 2), q)


def _q5(b: paddle.Tensor, qh_at: int) -> paddle.Tensor:
    """Q5_0/Q5_1's 5-bit values as float32 ``[R, B, 32]``. Element j's high bit is bit j of the
    little-endian uint32 qh: word g of the result (elements 4g..4g+3) takes nibble g of qh, and
    multiplying a nibble by 2^4 + 2^11 + 2^18 + 2^25 puts its bit k at bit 8k + 4 (the partial
    products do not overlap, so nothing carries), i.e. in byte k, already shifted to 16."""
    qh = _words(b, qh_at, qh_at + 4)                                    # [R, B, 1]
    nibbles = _spread(qh, list(range(0, 32, 4)), 0x0F).squeeze(-1)      # [R, B, 8]
    high = (nibbles * _const(0x02040810, qh)) & _const(0x10101010, qh)
    return _as_values(_nibble_words(_words(b, qh_at + 4, qh_at + 20)) | high)


def _q5_0(b: paddle.Tensor) -> paddle.Tensor:
    q = _q5(b, 2) - 16.0
    return q * _per(_f16(b, 0), q)


def _q5_1(b: paddle.Tensor) -> paddle.Tensor:
    q = _q5(b, 4)
    return q * _per(_f16(b, 0), q) + _per(_f16(b, 2), q)


def _k_low(b: paddle.Tensor, qs_at: int) -> paddle.Tensor:
    """Q4_K/Q5_K's 4-bit part as words ``[R, B, 8, 8]`` (8 sub-blocks of 32): 32-byte chunk i gives
    sub-block 2i (its low nibbles) and 2i + 1 (its high nibbles)."""
    rows, nb = b.shape[0], b.shape[1]
    return _nibble_words(_words(b, qs_at, qs_at + QK_K // 2).reshape([rows, nb, 4, 8])).reshape([rows, nb, 8, 8])


def _k_apply(b: paddle.Tensor, words: paddle.Tensor) -> paddle.Tensor:
    """``d * sc * q - dmin * m`` per 32-weight sub-block (ggml: ``d1 * q - m1``)."""
    rows, nb = b.shape[0], b.shape[1]
    scales, mins = _k_scales(b[:, :, 4:16])
    d1 = (_f16(b, 0) * scales).unsqueeze(-1)
    m1 = (_f16(b, 2) * mins).unsqueeze(-1)
    q = _as_values(words).reshape([rows, nb, 8, 32])
    return _per(d1, q) * q - _per(m1, q)


def _q4_k(b: paddle.Tensor) -> paddle.Tensor:
    return _k_apply(b, _k_low(b, 16))


def _q5_k(b: paddle.Tensor) -> paddle.Tensor:
    """The high bit of sub-block s's element l is bit s of qh byte l."""
    high = _spread(_words(b, 16, 48), list(range(8)), 0x01010101)       # [R, B, 8 sub-blocks, 8 words]
    return _k_apply(b, _k_low(b, 48) | (high << 4))


def _q6_k(b: paddle.Tensor) -> paddle.Tensor:
    """Each 128-weight half h: ql bytes [64h, 64h + 64) give its low nibbles (elements 0-63) then
    high nibbles (64-127); qh byte 32h + l gives bits 4-5 of elements l, l + 32, l + 64, l + 96 in
    its bit pairs 0-1, 2-3, 4-5, 6-7. Values are 6-bit minus 32; 16 int8 scales, one per 16."""
    rows, nb = b.shape[0], b.shape[1]
    low = _nibble_words(_words(b, 0, 128).reshape([rows, nb, 2, 16]))   # [R, B, 2 halves, 32 words]
    high = _spread(_words(b, 128, 192).reshape([rows, nb, 2, 8]), [0, 2, 4, 6], 0x03030303)   # [R, B, 2, 4, 8]
    q = _as_values(low.reshape([rows, nb, 2, 4, 8]) | (high << 4)).reshape([rows, nb, 16, 16]) - 32.0
    scale = (_f16(b, 208) * _int8(b, 192, 208)).unsqueeze(-1)          # d * sc first, as ggml
    return _per(scale, q) * q


_DEQUANT: dict[str, Callable[[paddle.Tensor], paddle.Tensor]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}
_FLOAT_VIEW = {"F32": paddle.float32, "F16": paddle.float16, "BF16": paddle.bfloat16}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("paddle.")


def dequantize(raw: paddle.Tensor, fmt: BlockFormat | str, k: int, dtype: str = "float32") -> paddle.Tensor:
    """``raw`` uint8 ``[..., row_bytes(fmt, k)]`` (rows of a GGUF tensor as stored, little endian)
    -> ``[..., k]`` in ``dtype``. Computed in float32, equal bit for bit to ggml's
    ``dequantize_row_*``, then cast (a float16/bfloat16 result is that float32 rounded to nearest
    even). Leading dims are kept: ``[N, bytes]`` for a linear weight, ``[T, bytes]`` for gathered
    embedding rows. F32/F16/BF16 rows asked for in their own dtype are a view of ``raw``'s memory."""
    f = _resolve(fmt)
    if not isinstance(raw, paddle.Tensor):
        raw = paddle.to_tensor(np.ascontiguousarray(raw))
    want = row_bytes(f, k)
    lead = list(raw.shape[:-1])
    if raw.dtype != paddle.uint8 or not raw.shape or raw.shape[-1] != want:
        raise ValueError(f"{f.name} rows of {k} weights are uint8 [..., {want}]; got {raw.dtype} {list(raw.shape)}")
    if prod(lead) == 0:   # no rows (an empty gather): paddle cannot view an empty tensor's bytes
        return raw.flatten()[:0].astype(dtype).reshape([*lead, k])       # on raw's device
    if f.name in _FLOAT_VIEW:
        out = _bytes_as(raw, _FLOAT_VIEW[f.name])
    else:
        rows, nblocks = prod(lead), k // f.block
        out = _DEQUANT[f.name](raw.reshape([rows, nblocks, f.nbytes]))
    out = out.reshape([*lead, k])
    if _dtype_name(out.dtype) == _dtype_name(dtype):
        return out
    out = out.astype("float32")    # exact; F16 -> bfloat16 then rounds once, from the exact value
    if _dtype_name(dtype) == "float16" and f.name in _FLOAT_VIEW:
        # paddle 3.3's CPU float32 -> float16 cast turns |x| in [2^-89, 2^-77) into garbage (2.1e-24
        # becomes 3.9e-5) instead of 0; everything below 2^-26 rounds to a signed zero, so make it
        # that first (copysign: ``out * 0.0`` is paddle's scale op, x * 0 + 0, which loses the sign).
        # Quantized blocks cannot reach this: their nonzero values are multiples of 2^-24.
        out = paddle.where(out.abs() < 2.0 ** -26, paddle.copysign(paddle.zeros_like(out), out), out)
    return out.astype(dtype)


# The float16 fields of each block type (scales, and the Q4_1/Q5_1/K-quant minimums), as byte ranges.
_F16_FIELDS = {"Q4_0": (0, 2), "Q5_0": (0, 2), "Q8_0": (0, 2), "Q4_1": (0, 4), "Q5_1": (0, 4), "Q4_K": (0, 4),
               "Q5_K": (0, 4), "Q6_K": (208, 210)}


def sample_blocks(fmt: BlockFormat | str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, row_bytes(fmt, k)]`` uint8: random blocks of ``fmt`` whose float16 fields are finite
    (either sign, 1e-4 to 1e-1), every bit pattern of the packed integers; F32/F16/BF16 rows of
    normal values of order 0.1. Why: a kernel's speed on a layer shape (`op_timing`) and its
    numerics on every pattern (the kernel tests) need blocks of every type, and ``gguf.quants``
    writes none of the K-quants."""
    f = _resolve(fmt)
    if f.name in _FLOAT_VIEW:
        values = (rng.standard_normal((rows, k)) * 0.1).astype(np.float32)
        if f.name == "F16":
            values = values.astype(np.float16)
        elif f.name == "BF16":
            values = (values.view(np.uint32) >> 16).astype(np.uint16)
        return values.view(np.uint8).reshape(rows, -1)
    raw = rng.integers(0, 256, (rows, k // f.block, f.nbytes), dtype=np.uint8)
    lo, hi = _F16_FIELDS[f.name]
    size = (rows, k // f.block, (hi - lo) // 2)
    scales = (rng.choice([-1.0, 1.0], size) * np.exp(rng.uniform(np.log(1e-4), np.log(1e-1), size))).astype(np.float16)
    raw[..., lo:hi] = scales.view(np.uint8).reshape(rows, k // f.block, hi - lo)
    return raw.reshape(rows, -1)
