"""FP8 (e4m3) block quantization: the one definition of fdplug's FP8 formats.

Part of the plugin contract, like the routing rule (`fdplug.plugin_api.moe`): the core's loader and
portable path, and every FP8 kernel plugin, quantize and lay out scales with these functions, so
they cannot disagree on a bit.

Each rule follows a published source (read, not copied):

* Weight format, DeepSeek-V3 ``README_WEIGHTS.md`` (deepseek-ai/DeepSeek-V3): ``weight`` e4m3
  ``[N, K]`` with ``weight_scale_inv`` float32, one scale per 128x128 block; a block not aligned to 128
  is zero-padded before its scale is taken and the padding is dropped after; ``W = block * scale_inv``.
* Quantizing a block or an activation group, DeepGEMM ``deep_gemm/utils/math.py``
  (``per_block_cast_to_fp8``, ``per_token_cast_to_fp8``; deepseek-ai/DeepGEMM): amax of the zero-padded
  block clamped to >= 1e-4 (an all-zero block gets a finite scale, never 0/0), ``scale = amax / 448``,
  rounded up to UE8M0 on request. DeepGEMM multiplies by ``1 / scale``; we divide, as vLLM's
  ``per_token_group_quant_fp8`` kernels do (``y / y_s``): exactly rounded, so reproducible bit for bit.
* UE8M0, DeepGEMM ``ceil_to_ue8m0`` / ``pack_ue8m0_to_int`` (math.py): biased exponent, plus one when
  the mantissa is nonzero, clamped to [1, 254]; 4 bytes per int32, the first in the lowest byte
  (``transpose_and_pack_fp32_into_ue8m0`` in ``deep_gemm/include/deep_gemm/impls/smxx_layout.cuh`` ORs
  ``sf[0] >> 23`` into bits 0-7, ``sf[1] >> 15`` into 8-15, ...; missing K entries pack as 0).
* SM100 scale layout, DeepGEMM ``csrc/apis/layout.hpp`` ``transform_sf_into_required_layout`` and
  ``csrc/jit_kernels/impls/smxx_layout.hpp`` (see `sm100_weight_scales`).
* UE8M0 requantization, vLLM ``requant_weight_ue8m0_inplace``
  (vllm-project/vllm ``vllm/model_executor/layers/quantization/utils/fp8_utils.py``, see `requant_ue8m0`).

Casting: paddle 3.3's float32 -> e4m3 cast rounds to nearest even and saturates 1e6, inf and NaN to
448, but turns 464 < |x| < 480 into the NaN code 0x7F. Quotients are therefore clamped to +-448 first
(vLLM clamps too), which changes nothing in range (``|w / scale| <= 448`` up to rounding).

Non-finite values: a NaN weight would still cast to a plausible, wrong 448, so `block_quant` refuses
non-finite weights. Activations are not checked (hot path): a NaN/inf makes its group's amax, hence
scale, non-finite (2^127 after UE8M0's clamp), and the group dequantizes to non-finite values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import paddle

FP8_MAX = 448.0                  # largest finite e4m3fn value
DEFAULT_BLOCK = (128, 128)       # DeepSeek-V3's weight_block_size
AMAX_FLOOR = 1e-4                # DeepGEMM's clamp: an all-zero block still gets a finite scale
FP8 = paddle.float8_e4m3fn
_FLOATS = (paddle.float16, paddle.bfloat16, paddle.float32, paddle.float64)
_MANTISSA = 0x7FFFFF


def _shape(x: Any) -> list[int]:
    return [int(d) for d in x.shape]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tensor(x: Any, name: str, dtypes: tuple = _FLOATS) -> paddle.Tensor:
    """``x`` as a paddle tensor of one of ``dtypes``; the error names the argument."""
    t = x if isinstance(x, paddle.Tensor) else paddle.to_tensor(x)
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    return t


def _matrix(x: paddle.Tensor, name: str) -> tuple[list[int], int, int]:
    """(leading dims, N, K) of a ``[..., N, K]`` tensor with N, K > 0."""
    shape = _shape(x)
    if len(shape) < 2 or shape[-1] <= 0 or shape[-2] <= 0:
        raise ValueError(f"{name} must be [..., N, K] with N, K > 0, got shape {shape}")
    return shape[:-2], shape[-2], shape[-1]


def _block(block: Sequence[int]) -> tuple[int, int]:
    try:
        bn, bk = (int(b) for b in block)
    except (TypeError, ValueError):
        raise ValueError(f"block must be two ints (rows, cols), got {block!r}") from None
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block sizes must be positive, got block={tuple(block)!r}")
    return bn, bk


def _group(group: int) -> int:
    if int(group) != group or group <= 0:
        raise ValueError(f"group must be a positive int, got group={group!r}")
    return int(group)


def _check_grid(scales: paddle.Tensor, name: str, want: list[int], of: str) -> None:
    if _shape(scales) != want:
        raise ValueError(f"{name} has shape {_shape(scales)}, expected {want} for {of}")


def _check_finite(x: paddle.Tensor, what: str) -> None:
    """Refuse NaN/inf: the e4m3 cast would saturate them to 448 without a trace."""
    finite = paddle.isfinite(x)
    if bool(finite.all()):
        return
    bad = paddle.logical_not(finite)
    first = tuple(int(i) for i in paddle.nonzero(bad)[0].tolist())
    raise ValueError(f"{what} has {int(bad.astype('int64').sum())} non-finite value(s) (NaN/inf), the first at "
                     f"index {first}; an e4m3 cast would silently turn them into +-448")


def _pad_last(x: paddle.Tensor, axis: int, size: int) -> paddle.Tensor:
    """Zero-pad ``x`` along ``axis`` to ``size``: edge blocks are padded with zeros (README_WEIGHTS.md)."""
    missing = size - int(x.shape[axis])
    if missing <= 0:
        return x
    shape = _shape(x)
    shape[axis] = missing
    return paddle.concat([x, paddle.zeros(shape, x.dtype)], axis=axis)


def _scale(amax: paddle.Tensor, ue8m0: bool) -> paddle.Tensor:
    """DeepGEMM's rule: ``max(amax, 1e-4) / 448``, rounded up to a power of two for UE8M0 kernels."""
    # maximum, not clip: paddle.clip's default upper bound would turn an inf amax into float32's max
    scale = paddle.maximum(amax, paddle.to_tensor(AMAX_FLOOR, "float32")) / FP8_MAX
    return ceil_to_ue8m0(scale) if ue8m0 else scale


def _to_e4m3(x: paddle.Tensor) -> paddle.Tensor:
    """float32 -> e4m3, clamped to +-448 first: paddle casts 464 < |x| < 480 to NaN (module docstring)."""
    return paddle.clip(x, -FP8_MAX, FP8_MAX).astype(FP8)


def _expand(scales: paddle.Tensor, axis: int, times: int, size: int) -> paddle.Tensor:
    """Repeat each scale ``times`` along ``axis`` and crop to ``size`` (the inverse of the padding)."""
    out = paddle.repeat_interleave(scales, times, axis=axis)
    return paddle.slice(out, axes=[axis], starts=[0], ends=[size])


def _bits(x: paddle.Tensor) -> paddle.Tensor:
    return x.astype("float32").contiguous().view(paddle.int32)


def ceil_to_ue8m0(scale: Any) -> paddle.Tensor:
    """``scale`` rounded up to a power of two, float32, same shape (DeepGEMM ``ceil_to_ue8m0``).

    Computed from the bits, not ``exp2(ceil(log2(x)))``: a float32 log2 can round ``2^k (1 + 2^-23)`` to
    exactly ``k`` and so round *down*. Like DeepGEMM, the sign is dropped and the biased exponent is
    clamped to [1, 254]: 0 and subnormals become 2^-126, inf and NaN become 2^127.
    """
    bits = paddle.bitwise_and(_bits(_tensor(scale, "scale")), paddle.to_tensor(0x7FFFFFFF, "int32"))
    exp = bits // (_MANTISSA + 1) + (bits % (_MANTISSA + 1) != 0).astype("int32")
    return (paddle.clip(exp, 1, 254) * (_MANTISSA + 1)).view(paddle.float32)


def ue8m0_exponents(scale: Any) -> paddle.Tensor:
    """The stored UE8M0 byte of ``scale``: the biased (bias 127) exponent of `ceil_to_ue8m0`, uint8."""
    return (_bits(ceil_to_ue8m0(scale)) // (_MANTISSA + 1)).astype("uint8")


def pack_ue8m0(exponents: Any) -> paddle.Tensor:
    """``[..., K]`` uint8 -> ``[..., ceil(K/4)]`` int32, 4 per word along K, the first in the lowest byte.

    K is zero-padded to a multiple of 4, as DeepGEMM's packer does. The bytes are reinterpreted in
    place, which puts byte 0 lowest on little-endian hosts (x86, ARM), DeepGEMM's order.
    """
    e = _tensor(exponents, "exponents", (paddle.uint8,))
    if e.ndim < 1 or int(e.shape[-1]) <= 0:
        raise ValueError(f"exponents must be [..., K] with K > 0, got shape {_shape(e)}")
    k = int(e.shape[-1])
    return _pad_last(e, e.ndim - 1, 4 * _cdiv(k, 4)).contiguous().view(paddle.int32)


def _block_quant(w: paddle.Tensor, bn: int, bk: int, ue8m0: bool) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Quantize a finite float32 ``[..., N, K]`` tile by tile (pad, amax per tile, divide, crop, cast)."""
    lead, n, k = _matrix(w, "w")
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    padded = _pad_last(_pad_last(w.reshape([-1, n, k]), 2, kb * bk), 1, nb * bn)
    tiles = padded.reshape([-1, nb, bn, kb, bk])
    scale = _scale(tiles.abs().max(axis=[2, 4]), ue8m0)
    q = (tiles / scale.reshape([-1, nb, 1, kb, 1])).reshape([-1, nb * bn, kb * bk])[:, :n, :k]
    return _to_e4m3(q).reshape(lead + [n, k]), scale.reshape(lead + [nb, kb])


def block_quant(w: Any, block: Sequence[int] = DEFAULT_BLOCK,
                ue8m0: bool = False) -> tuple[paddle.Tensor, paddle.Tensor]:
    """``w [..., N, K]`` -> (``q`` e4m3 ``[..., N, K]``, ``scale_inv`` float32 ``[..., ceil(N/bn), ceil(K/bk)]``).

    ``w ~= q * scale_inv`` per ``bn x bk`` block (DeepSeek-V3 format, DeepGEMM ``per_block_cast_to_fp8``
    numerics). ``ue8m0=True`` makes every scale a power of two, what Blackwell kernels need. Raises
    ValueError on NaN/inf weights (see the module docstring).
    """
    bn, bk = _block(block)
    w = _tensor(w, "w")
    _matrix(w, "w")
    w = w.astype("float32")
    _check_finite(w, "w")
    return _block_quant(w, bn, bk, ue8m0)


def block_dequant(q: Any, scale_inv: Any, block: Sequence[int] = DEFAULT_BLOCK,
                  dtype: str = "float32") -> paddle.Tensor:
    """``q [..., N, K]`` e4m3 times its block scales, as ``dtype`` (README_WEIGHTS.md's formula).

    The product is taken in float32 (every e4m3 value and every product of one with a float32 scale
    up to rounding is representable there), then cast to ``dtype``.
    """
    bn, bk = _block(block)
    q = _tensor(q, "q", (FP8,))
    s = _tensor(scale_inv, "scale_inv")
    lead, n, k = _matrix(q, "q")
    _check_grid(s, "scale_inv", lead + [_cdiv(n, bn), _cdiv(k, bk)], f"q of shape {_shape(q)} and block {(bn, bk)}")
    full = _expand(_expand(s.astype("float32"), s.ndim - 2, bn, n), s.ndim - 1, bk, k)
    w = q.astype("float32") * full
    return w if dtype == "float32" else w.astype(dtype)


def requant_ue8m0(q: Any, scale_inv: Any,
                  block: Sequence[int] = DEFAULT_BLOCK) -> tuple[paddle.Tensor, paddle.Tensor]:
    """A float-scale FP8 checkpoint -> the same weights with power-of-two (UE8M0) block scales.

    Follows vLLM ``requant_weight_ue8m0_inplace``: dequantize with the old scales, then quantize the
    result again block by block with ``use_ue8m0`` (its ``per_block_cast_to_fp8``), i.e. the new scale
    is ``ceil_to_ue8m0(max(amax(dequantized block), 1e-4) / 448)``. For a block whose largest ``|q|`` is
    448 (any block `block_quant` made) that is ``ceil_to_ue8m0(old scale)``; the result dequantizes to
    within one e4m3 rounding of the input. A NaN code in ``q`` or a non-finite scale is refused.
    """
    bn, bk = _block(block)
    w = block_dequant(q, scale_inv, (bn, bk))
    _check_finite(w, "the dequantized weight (q * scale_inv)")
    return _block_quant(w, bn, bk, ue8m0=True)


def per_token_group_quant(x: Any, group: int = 128,
                          ue8m0: bool = False) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Activations ``[..., H]`` -> (``q`` e4m3 ``[..., H]``, ``scales`` float32 ``[..., ceil(H/group)]``).

    One scale per token per ``1 x group`` slice (DeepGEMM ``per_token_cast_to_fp8``): H not a multiple
    of ``group`` pads the last group with zeros, as DeepGEMM does (vLLM's ``per_token_group_quant_fp8``
    instead requires ``H % group == 0``). Inputs are not checked for NaN/inf (module docstring).
    """
    g = _group(group)
    x = _tensor(x, "x")
    if x.ndim < 1 or int(x.shape[-1]) <= 0:
        raise ValueError(f"x must be [..., H] with H > 0, got shape {_shape(x)}")
    *lead, h = _shape(x)
    ng, tokens = _cdiv(h, g), 1
    for d in lead:
        tokens *= d
    groups = _pad_last(x.astype("float32").reshape([tokens, h]), 1, ng * g).reshape([tokens, ng, g])
    scale = _scale(groups.abs().max(axis=2), ue8m0)
    q = (groups / scale.unsqueeze(2)).reshape([tokens, ng * g])[:, :h]
    return _to_e4m3(q).reshape(lead + [h]), scale.reshape(lead + [ng])


def per_token_group_dequant(q: Any, scales: Any, group: int = 128, dtype: str = "float32") -> paddle.Tensor:
    """``q [..., H]`` e4m3 times its per-group scales ``[..., ceil(H/group)]``, as ``dtype``."""
    g = _group(group)
    q = _tensor(q, "q", (FP8,))
    s = _tensor(scales, "scales")
    if q.ndim < 1 or int(q.shape[-1]) <= 0:
        raise ValueError(f"q must be [..., H] with H > 0, got shape {_shape(q)}")
    h = int(q.shape[-1])
    _check_grid(s, "scales", _shape(q)[:-1] + [_cdiv(h, g)], f"q of shape {_shape(q)} and group {g}")
    w = q.astype("float32") * _expand(s.astype("float32"), s.ndim - 1, g, h)
    return w if dtype == "float32" else w.astype(dtype)


def sm100_weight_scales(scale_inv: Any, n: int, block: Sequence[int] = DEFAULT_BLOCK) -> paddle.Tensor:
    """Block scales ``[..., ceil(n/bn), ceil(K/bk)]`` -> DeepGEMM's SM100 (Blackwell) scale tensor.

    Confirmed in DeepGEMM ``transform_sf_into_required_layout`` (``csrc/apis/layout.hpp``): float32
    scales with ``gran_k`` 32 or 128 on SM100 are first broadcast to one row per output row
    (``index_select(-2, arange(mn) // gran_mn)``), then ``get_mn_major_tma_aligned_packed_ue8m0_tensor``
    (``csrc/jit_kernels/impls/smxx_layout.hpp``) packs 4 exponents per int32 along K and stores the
    result MN-major with the MN stride ``get_tma_aligned_size(mn, 4)`` = ``align(n, 4)`` (16 TMA bytes,
    ``csrc/utils/math.hpp``), batch stride ``packed_k * align(n, 4)``.

    Returned: that memory as a contiguous int32 ``[..., ceil(ceil(K/bk)/4), align(n, 4)]``; DeepGEMM's
    logical ``[..., n, packed_k]`` element ``[i, j]`` is ``out[..., j, i]``. Padding rows are 0
    (DeepGEMM's torch fallback zeroes them, its kernel leaves them unwritten). Activation scales from
    `per_token_group_quant` take the same layout with ``block=(1, group)``.

    DeepGEMM's packer keeps only the exponent bits (``>> 23``): a scale that is not a power of two
    would be truncated, disagreeing with ``q``. Such scales are refused; run `requant_ue8m0` first.
    """
    bn, bk = _block(block)
    if bk not in (32, 128):
        raise ValueError(f"block K must be 32 or 128 for DeepGEMM's SM100 scales, got block={(bn, bk)}")
    s = _tensor(scale_inv, "scale_inv", (paddle.float32,))
    lead, rows, _ = _matrix(s, "scale_inv")
    if int(n) <= 0 or rows != _cdiv(int(n), bn):
        raise ValueError(f"scale_inv has {rows} row blocks (shape {_shape(s)}), expected ceil({n}/{bn})")
    inexact = int((ceil_to_ue8m0(s) != s).astype("int64").sum())
    if inexact:
        raise ValueError(f"scale_inv has {inexact} value(s) that are not powers of two in [2^-126, 2^127]; "
                         "requant_ue8m0 the weight first")
    words = pack_ue8m0(ue8m0_exponents(_expand(s, s.ndim - 2, bn, int(n))))      # [..., n, packed_k]
    perm = list(range(len(lead))) + [len(lead) + 1, len(lead)]
    return _pad_last(words.transpose(perm).contiguous(), len(lead) + 1, 4 * _cdiv(int(n), 4)).contiguous()
