"""`fdplug.plugin_api.fp8` against an independent numpy implementation of the same formulas.

The reference never calls paddle: its own round-to-nearest-even e4m3 codec (1 sign bit, 4 exponent
bits with bias 7, 3 mantissa bits, subnormals 2^-9 apart, max 448, no inf), explicit loops over
blocks and groups instead of reshapes, ``frexp`` instead of bit tricks for UE8M0, and packing by
arithmetic instead of reinterpreting bytes. The module must match it bit for bit (e4m3 bytes,
float32 scales, int32 words); error bounds are checked on top.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from fdplug.plugin_api import fp8

RNG = np.random.default_rng(20250101)


# --- numpy reference -------------------------------------------------------------------------

def e4m3_encode(x) -> np.ndarray:
    """float32 -> e4m3fn bytes, round to nearest even; |x| beyond 448, inf and NaN saturate to +-448
    (the module's policy: it clamps before paddle's cast, which gives NaN for 464 < |x| < 480)."""
    x = np.asarray(x, np.float32).astype(np.float64)     # exact
    a = np.abs(x)
    code = np.full(x.shape, 0x7E, np.int64)               # saturated unless set below
    sub = a < 2.0 ** -6                                   # subnormal range: steps of 2^-9
    code[sub] = np.rint(a[sub] * 2.0 ** 9)                # 8 = the smallest normal's code
    normal = (a >= 2.0 ** -6) & np.isfinite(a)
    m, e = np.frexp(a[normal])                            # a = m 2^e, m in [0.5, 1)
    # biased exponent (e - 1 + 7), then 3 rounded mantissa bits; a mantissa rounding up to 8
    # carries into the exponent, which is exactly the next code
    code[normal] = (e + 6) * 8 + np.rint((2 * m - 1) * 8).astype(np.int64)
    code = np.minimum(code, 0x7E)                         # 0x7F is NaN: saturate instead
    return (code | (np.signbit(x).astype(np.int64) << 7)).astype(np.uint8)


def e4m3_decode(b) -> np.ndarray:
    b = np.asarray(b).astype(np.int64)
    assert not ((b & 0x7F) == 0x7F).any(), "a NaN code was produced"
    e, m = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7))
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


def ref_ue8m0(s) -> tuple[np.ndarray, np.ndarray]:
    """(smallest power of two >= |s| with exponent clamped to [-126, 127], its biased exponent byte)."""
    a = np.abs(np.asarray(s, np.float32).astype(np.float64))
    m, e = np.frexp(a)
    p = np.where(m == 0.5, e - 1, e)                      # exact powers of two stay
    p = np.where(a == 0, -126, np.where(np.isfinite(a), p, 127))
    p = np.clip(p, -126, 127)
    return (2.0 ** p).astype(np.float32), (p + 127).astype(np.uint8)


def ref_scale(amax, ue8m0: bool) -> np.float32:
    s = np.float32(max(np.float32(amax), np.float32(1e-4))) / np.float32(448.0)
    return ref_ue8m0(s)[0][()] if ue8m0 else np.float32(s)


def ref_block_quant(w: np.ndarray, bn: int, bk: int, ue8m0: bool = False):
    """Tile by tile; a cropped edge tile has the amax of its zero-padded tile (|x| >= 0)."""
    *lead, n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    q, s = np.zeros(w.shape, np.uint8), np.zeros((*lead, nb, kb), np.float32)
    for idx in np.ndindex(*lead):
        for i, j in itertools.product(range(nb), range(kb)):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            tile = w[idx][rows, cols]
            s[idx][i, j] = scale = ref_scale(np.abs(tile).max(), ue8m0)
            q[idx][rows, cols] = e4m3_encode(tile / scale)
    return q, s


def ref_block_dequant(q: np.ndarray, s: np.ndarray, bn: int, bk: int) -> np.ndarray:
    out = np.zeros(q.shape, np.float32)
    for idx in np.ndindex(*q.shape[:-2]):
        for i, j in np.ndindex(*s.shape[-2:]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            out[idx][rows, cols] = e4m3_decode(q[idx][rows, cols]) * s[idx][i, j]
    return out


def ref_token_quant(x: np.ndarray, g: int, ue8m0: bool = False):
    h = x.shape[-1]
    ng = -(-h // g)
    q, s = np.zeros(x.shape, np.uint8), np.zeros((*x.shape[:-1], ng), np.float32)
    for idx in np.ndindex(*x.shape[:-1]):
        for j in range(ng):
            part = x[idx][j * g:(j + 1) * g]
            s[idx][j] = scale = ref_scale(np.abs(part).max(), ue8m0)
            q[idx][j * g:(j + 1) * g] = e4m3_encode(part / scale)
    return q, s


def ref_pack(b: np.ndarray) -> np.ndarray:
    """4 bytes per word along the last axis, byte t at bits 8t..8t+7, missing bytes 0."""
    k = b.shape[-1]
    words = np.zeros((*b.shape[:-1], -(-k // 4)), np.uint64)
    for t in range(k):
        words[..., t // 4] += b[..., t].astype(np.uint64) << np.uint64(8 * (t % 4))
    return words.astype(np.uint32).view(np.int32)


def ref_sm100(s: np.ndarray, n: int, bn: int) -> np.ndarray:
    """DeepGEMM's rule, element by element: word (j, i) packs the exponents of row i // bn, K blocks 4j..4j+3."""
    *lead, _, kb = s.shape
    kp, aligned = -(-kb // 4), -(-n // 4) * 4
    out = np.zeros((*lead, kp, aligned), np.uint32)
    exps = ref_ue8m0(s)[1]
    for idx in np.ndindex(*lead):
        for j, i in itertools.product(range(kp), range(n)):
            out[idx][j, i] = sum(int(exps[idx][i // bn, 4 * j + t]) << (8 * t) for t in range(4) if 4 * j + t < kb)
    return out.view(np.int32)


# --- helpers ---------------------------------------------------------------------------------

def pt(a: np.ndarray):
    return paddle.to_tensor(np.ascontiguousarray(a))


def raw(q) -> np.ndarray:
    """The e4m3 bytes of a paddle fp8 tensor."""
    assert q.dtype == paddle.float8_e4m3fn
    return q.view(paddle.uint8).numpy()


def weights(*shape: int, spread: float = 3.0) -> np.ndarray:
    """Normal values with per-row magnitudes over several decades, so blocks get different scales."""
    mags = 10.0 ** RNG.uniform(-spread, spread / 2, size=(*shape[:-1], 1))
    return (RNG.standard_normal(shape) * mags).astype(np.float32)


def within_one_rounding(approx: np.ndarray, exact: np.ndarray, scale_per_elem: np.ndarray) -> bool:
    """|approx - exact| <= half an e4m3 step: 2^-4 relative in the normal range, 2^-10 x scale below it."""
    bound = np.maximum(np.abs(exact) * 2.0 ** -4, scale_per_elem * 2.0 ** -10) * (1 + 1e-6)
    return bool((np.abs(approx.astype(np.float64) - exact) <= bound).all())


def per_elem(s: np.ndarray, bn: int, bk: int, shape) -> np.ndarray:
    return np.repeat(np.repeat(s, bn, -2), bk, -1)[..., :shape[-2], :shape[-1]]


# --- the reference itself --------------------------------------------------------------------

def test_reference_codec_known_values():
    vals = [0.0, 1.0, -2.0, 448.0, 2.0 ** -9, 2.0 ** -6, 1.125, 0.5 * 2.0 ** -9, 1.5 * 2.0 ** -9, 464.0, 1e6]
    assert e4m3_encode(vals).tolist() == [0x00, 0x38, 0xC0, 0x7E, 0x01, 0x08, 0x39, 0x00, 0x02, 0x7E, 0x7E]
    assert e4m3_encode([1.0625, 1.1875, 2.0 ** -6 * 1.0625]).tolist() == [0x38, 0x3A, 0x08]   # ties to even


def test_reference_codec_round_trips_every_finite_code():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    assert (e4m3_encode(e4m3_decode(codes)) == codes).all()
    assert e4m3_decode(np.array([0x7E]))[0] == 448.0 and e4m3_decode(np.array([0x01]))[0] == 2.0 ** -9


def cast_inputs() -> np.ndarray:
    vals = e4m3_decode(np.arange(0x7F, dtype=np.uint8)).astype(np.float64)
    mids = (vals[:-1] + vals[1:]) / 2                      # exact ties
    x = np.concatenate([vals, mids, np.nextafter(mids.astype(np.float32), 0),
                        np.nextafter(mids.astype(np.float32), 1e9),
                        RNG.standard_normal(20000) * 10.0 ** RNG.uniform(-4, 3, 20000),
                        [449.0, 463.9, 464.0, 464.5, 470.0, 479.9, 480.0, 1e6, 3e38, np.inf]]).astype(np.float32)
    return np.concatenate([x, -x, [np.nan]])


def test_paddle_cast_is_round_to_nearest_even():
    """The module's only rounding is paddle's cast; pin it to the reference on ties and extremes
    (outside 464 < |x| < 480, where paddle gives the NaN code and the module clamps first)."""
    x = cast_inputs()
    window = (np.abs(x) > 464) & (np.abs(x) < 480)
    assert (raw(pt(x[~window]).astype(paddle.float8_e4m3fn)) == e4m3_encode(x[~window])).all()


def test_module_cast_saturates_everywhere():
    x = cast_inputs()
    codes = raw(fp8._to_e4m3(pt(x)))
    np.testing.assert_array_equal(codes, e4m3_encode(x))
    assert ((codes & 0x7F) != 0x7F).all()


# --- UE8M0 -----------------------------------------------------------------------------------

def test_ceil_to_ue8m0_edges():
    tiny = np.float32(2.0 ** -126)
    s = np.array([1.0, 1.5, 0.75, 2.0 ** -20, np.nextafter(np.float32(2.0 ** -20), 1), np.nextafter(np.float32(4), 0),
                  0.0, 1e-45, tiny, 3e38, 2.0 ** 127, np.inf, -0.3], np.float32)
    want = np.array([1.0, 2.0, 1.0, 2.0 ** -20, 2.0 ** -19, 4.0, tiny, tiny, tiny, 2.0 ** 127, 2.0 ** 127,
                     2.0 ** 127, 0.5], np.float32)
    out = fp8.ceil_to_ue8m0(pt(s))
    assert out.dtype == paddle.float32 and out.shape == [13]
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(out.numpy(), ref_ue8m0(s)[0])


def test_ceil_to_ue8m0_is_the_smallest_power_of_two_not_below():
    s = (10.0 ** RNG.uniform(-30, 30, (7, 33))).astype(np.float32)
    out = fp8.ceil_to_ue8m0(pt(s)).numpy()
    np.testing.assert_array_equal(out, ref_ue8m0(s)[0])
    assert (out >= s).all() and (out / 2 < s).all()
    assert (np.frexp(out)[0] == 0.5).all()                 # exactly powers of two


def test_ue8m0_exponents():
    s = np.concatenate([(10.0 ** RNG.uniform(-37, 37, 500)), [0.0, 1.0, 3e38, 1e-40]]).astype(np.float32)
    e = fp8.ue8m0_exponents(pt(s))
    assert e.dtype == paddle.uint8
    np.testing.assert_array_equal(e.numpy(), ref_ue8m0(s)[1])
    assert e.numpy().min() >= 1 and e.numpy().max() <= 254


@pytest.mark.parametrize("k", [1, 3, 4, 5, 8, 9, 130])
def test_pack_ue8m0(k):
    b = RNG.integers(0, 256, (2, 3, k)).astype(np.uint8)
    words = fp8.pack_ue8m0(pt(b))
    assert words.dtype == paddle.int32 and words.shape == [2, 3, -(-k // 4)]
    np.testing.assert_array_equal(words.numpy(), ref_pack(b))
    unpacked = np.stack([(words.numpy().view(np.uint32) >> (8 * t)) & 0xFF for t in range(4)], -1).reshape(2, 3, -1)
    np.testing.assert_array_equal(unpacked[..., :k], b)     # round trip, first byte lowest
    assert (unpacked[..., k:] == 0).all()                   # zero padding


def test_pack_ue8m0_rejects_other_dtypes():
    with pytest.raises(ValueError, match="exponents"):
        fp8.pack_ue8m0(pt(np.ones((2, 4), np.int32)))


# --- weight blocks ---------------------------------------------------------------------------

SHAPES = [  # (shape, block): aligned, edge blocks on N and/or K, odd K, single element, small blocks
    ((256, 256), (128, 128)), ((130, 200), (128, 128)), ((129, 127), (128, 128)), ((3, 257), (128, 128)),
    ((1, 1), (128, 128)), ((70, 45), (32, 16)), ((5, 7), (2, 3)),
]


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape,block", SHAPES)
def test_block_quant_matches_reference(shape, block, ue8m0):
    w = weights(*shape)
    q, s = fp8.block_quant(pt(w), block, ue8m0=ue8m0)
    rq, rs = ref_block_quant(w, *block, ue8m0)
    assert s.dtype == paddle.float32 and s.shape == list(rs.shape)
    np.testing.assert_array_equal(s.numpy(), rs)
    np.testing.assert_array_equal(raw(q), rq)


@pytest.mark.parametrize("shape,block", [((3, 70, 150), (32, 64)), ((2, 2, 40, 33), (16, 16)),
                                         ((4, 130, 129), (128, 128))])
def test_block_quant_leading_expert_dims(shape, block):
    w = weights(*shape)
    for ue8m0 in (False, True):
        q, s = fp8.block_quant(pt(w), block, ue8m0=ue8m0)
        rq, rs = ref_block_quant(w, *block, ue8m0)
        np.testing.assert_array_equal(s.numpy(), rs)
        np.testing.assert_array_equal(raw(q), rq)
        for e in range(shape[0]):                          # an expert alone quantizes the same
            qe, se = fp8.block_quant(pt(w[e]), block, ue8m0=ue8m0)
            np.testing.assert_array_equal(raw(qe), raw(q)[e])
            np.testing.assert_array_equal(se.numpy(), s.numpy()[e])


def test_zero_and_tiny_blocks_get_the_floor_scale():
    w = weights(64, 96)
    w[:32, :32] = 0.0                                      # an all-zero block
    w[32:, 32:64] = 1e-7                                   # amax below the 1e-4 floor
    q, s = fp8.block_quant(pt(w), (32, 32))
    floor = np.float32(np.float32(1e-4) / np.float32(448))
    assert s.numpy()[0, 0] == floor and s.numpy()[1, 1] == floor
    assert (raw(q)[:32, :32] == 0).all()
    np.testing.assert_array_equal(raw(q)[32:, 32:64], e4m3_encode(np.float32(1e-7) / floor))
    np.testing.assert_array_equal(raw(q), ref_block_quant(w, 32, 32)[0])
    assert np.isfinite(fp8.block_dequant(q, s, (32, 32)).numpy()).all()


@pytest.mark.parametrize("ue8m0", [False, True])
def test_large_values_scale_instead_of_saturating(ue8m0):
    w = weights(40, 40)
    w[:20, :20] *= 1e6 / np.abs(w[:20, :20]).max()         # a block whose amax is 1e6
    w[20:, 20:] = 3e38 * np.sign(w[20:, 20:])              # near float32's max
    q, s = fp8.block_quant(pt(w), (20, 20), ue8m0=ue8m0)
    codes = raw(q)
    assert ((codes & 0x7F) <= 0x7E).all()                  # no NaN code
    top = np.abs(e4m3_decode(codes[:20, :20])).max()
    assert top == 448.0 if not ue8m0 else 224.0 <= top <= 448.0    # amax lands on 448 (ue8m0: within 2x)
    assert (np.abs(e4m3_decode(codes[20:, 20:])) == (224.0 if ue8m0 else 448.0)).all()   # 3e38 / 2^120
    np.testing.assert_array_equal(codes, ref_block_quant(w, 20, 20, ue8m0)[0])
    back = fp8.block_dequant(q, s, (20, 20)).numpy()
    assert within_one_rounding(back, w, per_elem(s.numpy(), 20, 20, w.shape))


def division_sensitive_row() -> tuple[np.ndarray, np.float32]:
    """amax 3.7 plus values whose quotient w / scale is exactly an e4m3 tie but w * (1 / scale) is not."""
    amax = np.float32(3.7)
    s = amax / np.float32(448)
    vals = e4m3_decode(np.arange(0x08, 0x7E, dtype=np.uint8)).astype(np.float64)
    found = [amax]
    for tie in ((vals[:-1] + vals[1:]) / 2).astype(np.float32):
        w = tie * s
        if w / s == tie and w * (np.float32(1) / s) != tie:
            found.append(w)
    row = np.array(found, np.float32)
    assert row.size > 10 and (e4m3_encode(row / s) != e4m3_encode(row * (np.float32(1) / s))).sum() > 10
    return row, s


def test_quotients_are_true_divisions():
    """q = cast(w / scale), exactly rounded; a multiply by 1 / scale moves these ties (DeepGEMM's form)."""
    row, s = division_sensitive_row()
    q, sc = fp8.block_quant(pt(row[None, :]), (1, row.size))
    assert sc.numpy()[0, 0] == s
    np.testing.assert_array_equal(raw(q)[0], e4m3_encode(row / s))
    qa, sa = fp8.per_token_group_quant(pt(row[None, :]), row.size)
    assert sa.numpy()[0, 0] == s
    np.testing.assert_array_equal(raw(qa)[0], e4m3_encode(row / s))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_block_quant_refuses_non_finite(bad):
    w = weights(2, 8, 16)
    w[1, 5, 7] = bad
    w[1, 6, 0] = np.nan
    with pytest.raises(ValueError, match=r"w has 2 non-finite value.*\(1, 5, 7\)"):
        fp8.block_quant(pt(w), (4, 4))


@pytest.mark.parametrize("w,block,match", [
    (np.ones(8, np.float32), (4, 4), r"w must be \[\.\.\., N, K\].*\[8\]"),
    (np.ones((8, 0), np.float32), (4, 4), r"N, K > 0, got shape \[8, 0\]"),
    (np.ones((8, 8), np.float32), (0, 128), "block sizes must be positive"),
    (np.ones((8, 8), np.float32), (128,), "block must be two ints"),
    (np.ones((8, 8), np.int32), (4, 4), "w must have dtype"),
])
def test_block_quant_validation(w, block, match):
    with pytest.raises(ValueError, match=match):
        fp8.block_quant(pt(w), block)


@pytest.mark.parametrize("shape,block", SHAPES[:4] + [((3, 70, 150), (32, 64))])
def test_block_dequant_matches_reference(shape, block):
    w = weights(*shape)
    rq, rs = ref_block_quant(w, *block)
    q = pt(rq).view(paddle.float8_e4m3fn)
    out = fp8.block_dequant(q, pt(rs), block)
    assert out.dtype == paddle.float32 and out.shape == list(shape)
    np.testing.assert_array_equal(out.numpy(), ref_block_dequant(rq, rs, *block))
    half = fp8.block_dequant(q, pt(rs), block, dtype="bfloat16")
    assert half.dtype == paddle.bfloat16
    np.testing.assert_allclose(half.astype("float32").numpy(), out.numpy(), rtol=2 ** -8, atol=0)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_round_trip_is_within_one_e4m3_rounding(ue8m0):
    w = weights(3, 150, 260)
    q, s = fp8.block_quant(pt(w), ue8m0=ue8m0)
    back = fp8.block_dequant(q, s).numpy()
    sc = per_elem(s.numpy(), 128, 128, w.shape)
    assert within_one_rounding(back, w, sc)
    assert np.abs(back - w).max() > 0                     # it did round
    amax = np.abs(w).max()
    assert np.abs(back - w).max() <= amax * 2.0 ** -4


@pytest.mark.parametrize("scale_shape,match", [((2, 3), r"scale_inv has shape \[2, 3\], expected \[2, 2\]"),
                                               ((2,), r"scale_inv has shape \[2\], expected \[2, 2\]")])
def test_block_dequant_validation(scale_shape, match):
    q, _ = fp8.block_quant(pt(weights(130, 200)))
    with pytest.raises(ValueError, match=match):
        fp8.block_dequant(q, pt(np.ones(scale_shape, np.float32)))
    with pytest.raises(ValueError, match="q must have dtype"):
        fp8.block_dequant(pt(weights(130, 200)), pt(np.ones((2, 2), np.float32)))
    with pytest.raises(ValueError, match="block sizes must be positive"):
        fp8.block_dequant(q, pt(np.ones((2, 2), np.float32)), (128, -1))


# --- UE8M0 requantization ----------------------------------------------------------------------

@pytest.mark.parametrize("shape,block", [((130, 200), (128, 128)), ((3, 70, 45), (32, 16)), ((1, 1), (128, 128))])
def test_requant_ue8m0_matches_reference(shape, block):
    w = weights(*shape)
    rq, rs = ref_block_quant(w, *block)
    q, s = fp8.requant_ue8m0(pt(rq).view(paddle.float8_e4m3fn), pt(rs), block)
    nq, ns = ref_block_quant(ref_block_dequant(rq, rs, *block), *block, ue8m0=True)
    np.testing.assert_array_equal(s.numpy(), ns)
    np.testing.assert_array_equal(raw(q), nq)


def test_requant_ue8m0_keeps_the_weights():
    w = weights(2, 150, 300)
    w[0, :128, :128] = 0.0
    q0, s0 = fp8.block_quant(pt(w))
    q, s = fp8.requant_ue8m0(q0, s0)
    old, new = s0.numpy(), s.numpy()
    assert (np.frexp(new)[0] == 0.5).all()                  # powers of two
    np.testing.assert_array_equal(new, ref_ue8m0(old)[0])  # = ceil_to_ue8m0(old) for blocks block_quant made
    assert (new >= old).all() and (new < 2 * old).all()
    before = fp8.block_dequant(q0, s0).numpy()
    after = fp8.block_dequant(q, s).numpy()
    assert within_one_rounding(after, before, per_elem(new, 128, 128, w.shape))
    assert (after[0, :128, :128] == 0).all()


def test_requant_ue8m0_refuses_nan_codes():
    q, s = fp8.block_quant(pt(weights(8, 8)), (4, 4))
    codes = raw(q).copy()
    codes[2, 3] = 0x7F
    with pytest.raises(ValueError, match=r"dequantized weight.*1 non-finite.*\(2, 3\)"):
        fp8.requant_ue8m0(pt(codes).view(paddle.float8_e4m3fn), s, (4, 4))


# --- activations -------------------------------------------------------------------------------

@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("h,group", [(128, 128), (256, 128), (200, 128), (1, 128), (129, 128), (383, 64), (7, 2)])
def test_per_token_group_quant_matches_reference(h, group, ue8m0):
    x = weights(9, h)
    x[4] = 0.0                                              # an all-zero token
    q, s = fp8.per_token_group_quant(pt(x), group, ue8m0=ue8m0)
    rq, rs = ref_token_quant(x, group, ue8m0)
    assert q.shape == [9, h] and s.shape == [9, -(-h // group)] and s.dtype == paddle.float32
    np.testing.assert_array_equal(s.numpy(), rs)
    np.testing.assert_array_equal(raw(q), rq)
    assert (raw(q)[4] == 0).all()
    back = fp8.per_token_group_dequant(q, s, group).numpy()
    np.testing.assert_array_equal(back, ref_block_dequant(rq, rs, 1, group))
    assert within_one_rounding(back, x, np.repeat(s.numpy(), group, -1)[:, :h])


def test_per_token_group_quant_leading_dims_and_dtype():
    x = weights(2, 3, 200)
    q, s = fp8.per_token_group_quant(pt(x).astype("bfloat16"), 128)
    rq, rs = ref_token_quant(pt(x).astype("bfloat16").astype("float32").numpy(), 128)
    assert q.shape == [2, 3, 200] and s.shape == [2, 3, 2]
    np.testing.assert_array_equal(raw(q), rq)
    np.testing.assert_array_equal(s.numpy(), rs)
    assert fp8.per_token_group_dequant(q, s, 128, dtype="bfloat16").dtype == paddle.bfloat16


def test_per_token_group_validation():
    q, s = fp8.per_token_group_quant(pt(weights(4, 200)), 128)
    with pytest.raises(ValueError, match=r"scales has shape \[4, 1\], expected \[4, 2\]"):
        fp8.per_token_group_dequant(q, s[:, :1], 128)
    with pytest.raises(ValueError, match="group must be a positive int"):
        fp8.per_token_group_quant(pt(weights(4, 200)), 0)
    with pytest.raises(ValueError, match="x must be"):
        fp8.per_token_group_quant(pt(np.ones((4, 0), np.float32)))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_non_finite_activation_is_not_hidden(ue8m0):
    x = weights(3, 256)
    x[1, 10] = np.nan
    x[2, 200] = np.inf
    q, s = fp8.per_token_group_quant(pt(x), 128, ue8m0=ue8m0)
    back = fp8.per_token_group_dequant(q, s, 128).numpy()
    assert not np.isfinite(back[1, 10]) and not np.isfinite(back[2, 200])
    assert np.isfinite(back[0]).all()


# --- SM100 layout ----------------------------------------------------------------------------

@pytest.mark.parametrize("shape,block", [((130, 700), (128, 128)), ((2, 257, 300), (128, 128)), ((1, 128), (128, 128)),
                                         ((256, 1024), (128, 128)), ((3, 64, 96), (16, 32)), ((6, 40), (4, 32))])
def test_sm100_weight_scales_layout(shape, block):
    n = shape[-2]
    _, s = fp8.block_quant(pt(weights(*shape)), block, ue8m0=True)
    out = fp8.sm100_weight_scales(s, n, block)
    want = ref_sm100(s.numpy(), n, block[0])
    assert out.dtype == paddle.int32 and out.shape == list(want.shape)
    assert want.shape[-1] == -(-n // 4) * 4
    np.testing.assert_array_equal(out.numpy(), want)


def test_sm100_activation_scales_use_the_same_layout():
    _, s = fp8.per_token_group_quant(pt(weights(7, 1000)), 128, ue8m0=True)   # [7, 8]
    out = fp8.sm100_weight_scales(s, 7, (1, 128))
    assert out.shape == [2, 8]
    np.testing.assert_array_equal(out.numpy(), ref_sm100(s.numpy(), 7, 1))


def test_sm100_weight_scales_validation():
    w = pt(weights(130, 300))
    _, floats = fp8.block_quant(w)
    with pytest.raises(ValueError, match="not powers of two"):
        fp8.sm100_weight_scales(floats, 130)
    _, pow2 = fp8.block_quant(w, ue8m0=True)
    with pytest.raises(ValueError, match=r"2 row blocks.*expected ceil\(300/128\)"):
        fp8.sm100_weight_scales(pow2, 300)
    with pytest.raises(ValueError, match="block K must be 32 or 128"):
        fp8.sm100_weight_scales(pow2, 130, (128, 64))
