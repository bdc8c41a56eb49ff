"""`fdplug.core.quant.gguf_blocks` against the gguf package and against ggml's C loops.

Two references, both independent of the module's reshapes and bit tricks:

* ``gguf.quants.dequantize`` (the gguf package's numpy port of ggml-quants.c), on tensors written
  to real GGUF files with ``gguf.GGUFWriter`` and read back with ``gguf.GGUFReader``: every type,
  several shapes, the data quantized from floats where ``gguf.quants.quantize`` can, and random
  block bytes (every bit pattern of the packed fields, the float16 scales overwritten with finite
  values) for every type.
* `ggml_scalar`, a transcription of ggml-quants.c's ``dequantize_row_*`` element loops, one weight at
  a time in numpy float32, so a layout mistake shared by the numpy port and the module would show.

Everything is compared bit for bit (float32 words), on NaN-free data.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")
gguf = pytest.importorskip("gguf")

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from fdplug.core.quant import gguf_blocks as gb
from fdplug.errors import UnsupportedModelError

RNG_SEED = 20250611
SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
QUANTIZED = SUPPORTED[3:]
FLOATS = SUPPORTED[:3]
SHAPES = ((3, 256), (7, 512), (2, 3, 512))
# byte offsets of each block's float16 scales (ggml's block_* structs)
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def qtype(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name]


def bits(x: np.ndarray) -> np.ndarray:
    """float32 words, so -0.0 != 0.0 and the comparison is bit for bit."""
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


def gguf_can_quantize(name: str) -> bool:
    try:
        quants.quantize(np.zeros((1, 256), np.float32), qtype(name))
    except NotImplementedError:
        return False
    return True


QUANTIZABLE = tuple(n for n in SUPPORTED if gguf_can_quantize(n))


def finite_f16(rng: np.random.Generator, shape) -> np.ndarray:
    """Scales as a quantizer would write them: mostly ~1e-2, some large, tiny, subnormal, zero and
    negative (random bytes would make inf/NaN)."""
    v = rng.standard_normal(shape) * 10.0 ** rng.integers(-7, 2, shape)
    v.flat[::17] = 0.0
    return v.astype(np.float16)


def random_blocks(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Raw bytes ``quant_shape_to_byte_shape(shape)`` of random blocks with finite float16 scales;
    for the float formats, random finite values."""
    *lead, k = shape
    if name == "F32":
        v = rng.standard_normal(shape).astype(np.float32) * np.float32(10.0) ** rng.integers(-40, 30, shape)
        return v.astype(np.float32).view(np.uint8)
    if name in ("F16", "BF16"):
        words = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
        exp = (words >> 10) & 0x1F if name == "F16" else (words >> 7) & 0xFF
        words[exp == (0x1F if name == "F16" else 0xFF)] &= 0x83FF if name == "F16" else 0x807F  # no inf/NaN
        return words.view(np.uint8)
    fmt = gb.BLOCK_FORMATS[name]
    raw = rng.integers(0, 256, (*lead, k // fmt.block, fmt.nbytes), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        raw[..., at:at + 2] = finite_f16(rng, raw.shape[:-1]).view(np.uint8).reshape(*raw.shape[:-1], 2)
    return raw.reshape(gguf.quant_shape_to_byte_shape(shape, qtype(name)))


def quantized_from_floats(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    w.reshape(-1)[:: 37] *= 40.0   # outliers, as real weights have
    return np.ascontiguousarray(quants.quantize(w, qtype(name))).view(np.uint8).reshape(
        gguf.quant_shape_to_byte_shape(shape, qtype(name)))


def deq(raw: np.ndarray, name: str, k: int, dtype: str = "float32") -> np.ndarray:
    out = gb.dequantize(paddle.to_tensor(raw), name, k, dtype)
    assert list(out.shape) == [*raw.shape[:-1], k]
    return out.astype("float32").numpy() if dtype != "float32" else out.numpy()


# --- the table ----------------------------------------------------------------------------------

def test_table_is_exactly_the_supported_types_with_ggmls_numbers():
    assert sorted(gb.BLOCK_FORMATS) == sorted(SUPPORTED)
    for name, fmt in gb.BLOCK_FORMATS.items():
        assert fmt.name == name
        assert fmt.ggml_type == qtype(name) and GGMLQuantizationType(fmt.ggml_type).name == name
        assert (fmt.block, fmt.nbytes) == GGML_QUANT_SIZES[qtype(name)]
    fmt = gb.BLOCK_FORMATS["Q4_1"]
    with pytest.raises(AttributeError):
        fmt.nbytes = 1          # frozen
    assert not hasattr(fmt, "__dict__")   # slots


@pytest.mark.parametrize("name", SUPPORTED)
def test_format_of_by_name_type_and_id(name):
    fmt = gb.BLOCK_FORMATS[name]
    assert gb.format_of(name) is fmt
    assert gb.format_of(name.lower()) is fmt
    assert gb.format_of(qtype(name)) is fmt
    assert gb.format_of(int(qtype(name))) is fmt


@pytest.mark.parametrize("name", ["IQ2_XS", "Q2_K", "Q3_K", "TQ1_0", "Q8_1", "Q8_K", "IQ4_NL", "MXFP4", "I8", "F64"])
def test_format_of_refuses_other_types(name):
    for arg in (name, qtype(name)):
        with pytest.raises(UnsupportedModelError) as err:
            gb.format_of(arg)
        assert name in str(err.value)
        assert all(s in err.value.message for s in SUPPORTED)
        assert err.value.fix
    with pytest.raises(UnsupportedModelError, match=f"type id {int(qtype(name))}"):
        gb.format_of(int(qtype(name)))


@pytest.mark.parametrize("bad", ["Q4", "", "q4_k_m", 99, True, 4.0])
def test_format_of_refuses_junk(bad):
    with pytest.raises(UnsupportedModelError):
        gb.format_of(bad)


@pytest.mark.parametrize("name", SUPPORTED)
def test_row_bytes_matches_gguf(name):
    fmt = gb.BLOCK_FORMATS[name]
    for k in (256, 512, 768, 4096, 14336):
        expect = gguf.quant_shape_to_byte_shape((k,), qtype(name))[-1]
        assert gb.row_bytes(name, k) == gb.row_bytes(fmt, k) == expect


@pytest.mark.parametrize(("name", "k"), [("Q4_K", 288), ("Q6_K", 576), ("Q4_0", 48), ("Q8_0", 33), ("Q4_0", 0),
                                         ("F16", -2)])
def test_row_bytes_refuses_a_partial_block(name, k):
    block = gb.BLOCK_FORMATS[name].block
    with pytest.raises(ValueError, match=f"multiple of {block}"):
        gb.row_bytes(name, k)
    with pytest.raises(ValueError, match=f"multiple of {block}"):
        gb.dequantize(paddle.zeros([1, 18], "uint8"), name, k)


def test_dequantize_refuses_wrong_bytes():
    with pytest.raises(ValueError, match=r"uint8 \[\.\.\., 20\]"):
        gb.dequantize(paddle.zeros([4, 18], "uint8"), "Q4_1", 32)
    with pytest.raises(ValueError, match="uint8"):
        gb.dequantize(paddle.zeros([4, 20], "int32"), "Q4_1", 32)
    with pytest.raises(UnsupportedModelError):
        gb.dequantize(paddle.zeros([4, 66], "uint8"), "Q2_K", 256)


# --- GGUF files ---------------------------------------------------------------------------------

def test_gguf_quantize_covers_the_legacy_types():
    """The float-data half of the file test must not silently shrink to nothing."""
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"} <= set(QUANTIZABLE)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """One GGUF file: every type x every shape, random blocks and (where gguf can) quantized floats.
    Returns the reader and the bytes written, by tensor name."""
    rng = np.random.default_rng(RNG_SEED)
    path = tmp_path_factory.mktemp("gguf") / "blocks.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    written = {}
    for name in SUPPORTED:
        for i, shape in enumerate(SHAPES):
            tensors = {f"{name}.random.{i}": random_blocks(name, shape, rng)}
            if name in QUANTIZABLE:
                tensors[f"{name}.quantized.{i}"] = quantized_from_floats(name, shape, rng)
            for tname, raw in tensors.items():
                assert raw.dtype == np.uint8 and raw.shape == gguf.quant_shape_to_byte_shape(shape, qtype(name))
                writer.add_tensor(tname, raw, raw_dtype=qtype(name))
                written[tname] = raw
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path)), written


@pytest.mark.parametrize("name", SUPPORTED)
def test_dequantize_matches_gguf_on_a_gguf_file(gguf_file, name):
    reader, written = gguf_file
    tensors = [t for t in reader.tensors if t.name.split(".")[0] == name]
    assert len(tensors) == len(SHAPES) * (2 if name in QUANTIZABLE else 1)
    for t in tensors:
        assert t.tensor_type == qtype(name)
        raw = np.ascontiguousarray(t.data).view(np.uint8)
        assert np.array_equal(raw, written[t.name])           # the file round-trips the bytes
        ref = quants.dequantize(t.data, t.tensor_type)
        k = ref.shape[-1]
        assert ref.dtype == np.float32 and np.isfinite(ref).all() and np.count_nonzero(ref) > ref.size // 8
        got = deq(raw, name, k)
        assert got.shape == ref.shape == (*raw.shape[:-1], k)
        assert np.array_equal(bits(got), bits(ref)), f"{t.name}: max diff {np.abs(got - ref).max()}"


# --- ggml's C loops, transcribed ------------------------------------------------------------------

def _f16(b: np.ndarray, at: int) -> np.float32:
    return np.float32(b[at:at + 2].view(np.float16)[0])


def _scale_min_k4(j: int, s: np.ndarray) -> tuple[int, int]:
    """ggml-quants.c ``get_scale_min_k4``."""
    s = s.astype(np.int64)
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def ggml_scalar(name: str, block: np.ndarray) -> np.ndarray:
    """One block, weight by weight, as ggml-quants.c's ``dequantize_row_<name>`` (float32 math)."""
    f32 = np.float32
    y = np.zeros(gb.BLOCK_FORMATS[name].block, np.float32)
    b = block
    if name == "Q8_0":
        d = _f16(b, 0)
        for j in range(32):
            y[j] = f32(b[2 + j:3 + j].view(np.int8)[0]) * d
    elif name in ("Q4_0", "Q4_1"):
        d = _f16(b, 0)
        qs = b[2:] if name == "Q4_0" else b[4:]
        for j in range(16):
            x0, x1 = int(qs[j]) & 0xF, int(qs[j]) >> 4
            if name == "Q4_0":
                y[j], y[j + 16] = f32(x0 - 8) * d, f32(x1 - 8) * d
            else:
                m = _f16(b, 2)
                y[j], y[j + 16] = f32(x0) * d + m, f32(x1) * d + m
    elif name in ("Q5_0", "Q5_1"):
        d = _f16(b, 0)
        at = 2 if name == "Q5_0" else 4
        qh = int.from_bytes(bytes(b[at:at + 4]), "little")
        qs = b[at + 4:]
        for j in range(16):
            xh0 = ((qh >> j) << 4) & 0x10
            xh1 = (qh >> (j + 12)) & 0x10
            x0, x1 = (int(qs[j]) & 0xF) | xh0, (int(qs[j]) >> 4) | xh1
            if name == "Q5_0":
                y[j], y[j + 16] = f32(x0 - 16) * d, f32(x1 - 16) * d
            else:
                m = _f16(b, 2)
                y[j], y[j + 16] = f32(x0) * d + m, f32(x1) * d + m
    elif name in ("Q4_K", "Q5_K"):
        d, dmin, scales = _f16(b, 0), _f16(b, 2), b[4:16]
        qh, ql = (None, b[16:144]) if name == "Q4_K" else (b[16:48], b[48:176])
        out, u1, u2 = 0, 1, 2
        for j in range(0, 256, 64):
            is_ = j // 32
            sc, m = _scale_min_k4(is_, scales)
            d1, m1 = d * f32(sc), dmin * f32(m)
            sc, m = _scale_min_k4(is_ + 1, scales)
            d2, m2 = d * f32(sc), dmin * f32(m)
            q = ql[j // 2: j // 2 + 32].astype(np.int64)
            for lo in range(32):
                h = 16 if qh is not None and qh[lo] & u1 else 0
                y[out] = d1 * f32((q[lo] & 0xF) + h) - m1
                out += 1
            for lo in range(32):
                h = 16 if qh is not None and qh[lo] & u2 else 0
                y[out] = d2 * f32((q[lo] >> 4) + h) - m2
                out += 1
            u1, u2 = u1 << 2, u2 << 2
    elif name == "Q6_K":
        ql, qh, sc, d = b[0:128].astype(np.int64), b[128:192].astype(np.int64), b[192:208].view(np.int8), _f16(b, 208)
        for n in range(2):
            base, qlo, qho, sco = 128 * n, 64 * n, 32 * n, 8 * n
            for lo in range(32):
                is_ = lo // 16
                h = qh[qho + lo]
                q1 = ((ql[qlo + lo] & 0xF) | (((h >> 0) & 3) << 4)) - 32
                q2 = ((ql[qlo + lo + 32] & 0xF) | (((h >> 2) & 3) << 4)) - 32
                q3 = ((ql[qlo + lo] >> 4) | (((h >> 4) & 3) << 4)) - 32
                q4 = ((ql[qlo + lo + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32
                for off, q, s in ((0, q1, 0), (32, q2, 2), (64, q3, 4), (96, q4, 6)):
                    y[base + lo + off] = d * f32(sc[sco + is_ + s]) * f32(q)
    else:
        raise AssertionError(name)
    return y


@pytest.mark.parametrize("name", QUANTIZED)
def test_dequantize_matches_ggmls_c_loops(name):
    rng = np.random.default_rng(RNG_SEED + 1)
    fmt = gb.BLOCK_FORMATS[name]
    k = 2 * max(fmt.block, 256 // fmt.block * fmt.block)        # 2 K-blocks or 16 small blocks
    raw = random_blocks(name, (2, k), rng)
    ref = np.stack([np.concatenate([ggml_scalar(name, blk) for blk in row.reshape(-1, fmt.nbytes)])
                    for row in raw])
    assert np.isfinite(ref).all()
    assert np.array_equal(bits(deq(raw, name, k)), bits(ref))
    assert np.array_equal(bits(quants.dequantize(raw, qtype(name))), bits(ref))   # and gguf agrees


def test_element_order_by_hand():
    """A Q4_0 block whose byte j is j | (15 - j) << 4, scale 1: the low nibbles are the first half
    (0..15 minus 8), the high nibbles the second (15..0 minus 8)."""
    block = np.concatenate([np.float16(1.0).reshape(1).view(np.uint8),
                            np.array([j | (15 - j) << 4 for j in range(16)], np.uint8)])
    expect = np.array([*range(16), *range(15, -1, -1)], np.float32) - 8
    assert np.array_equal(deq(block.reshape(1, -1), "Q4_0", 32)[0], expect)
    # Q5_0: only bit 17 of qh set -> element 17 (a high nibble) gains 16
    block = np.zeros(22, np.uint8)
    block[0:2] = np.float16(1.0).reshape(1).view(np.uint8)
    block[2 + 2] = 1 << 1
    expect = np.full(32, -16, np.float32)
    expect[17] = 0
    assert np.array_equal(deq(block.reshape(1, -1), "Q5_0", 32)[0], expect)


# --- float formats, dtypes, slices, shapes --------------------------------------------------------

@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_every_16_bit_pattern(name):
    words = np.arange(1 << 16, dtype=np.uint16)
    raw = words.view(np.uint8).reshape(256, 512)
    got = deq(raw, name, 256)
    ref = quants.dequantize(words.view(np.float16) if name == "F16" else raw, qtype(name)).reshape(256, 256)
    nan = np.isnan(ref)
    assert np.isfinite(ref).sum() == (63488 if name == "F16" else 65280)
    assert np.array_equal(bits(got)[~nan], bits(ref)[~nan])      # subnormals, +-0 and +-inf included
    assert np.isnan(got[nan]).all()


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (as float32), round to nearest even; NaN-free input."""
    u = bits(x).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("name", SUPPORTED)
def test_dtype_rounds_the_float32_result(name):
    rng = np.random.default_rng(RNG_SEED + 2)
    raw = random_blocks(name, (5, 512), rng)
    exact = deq(raw, name, 512)
    assert np.array_equal(bits(deq(raw, name, 512, "bfloat16")), bits(round_bf16(exact)))
    with np.errstate(over="ignore"):   # F32/BF16 values beyond float16's range become inf, as in paddle
        as_f16 = exact.astype(np.float16).astype(np.float32)
    assert np.array_equal(bits(deq(raw, name, 512, "float16")), bits(as_f16))
    assert gb.dequantize(paddle.to_tensor(raw), name, 512, paddle.bfloat16).dtype == paddle.bfloat16


def test_bfloat16_ties_go_to_even():
    x = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -(1 + 2 ** -8), 3 * 2 ** -9], np.float32)
    got = deq(x.view(np.uint8).reshape(1, -1), "F32", 5, "bfloat16")[0]
    assert got.tolist() == [1.0, 1 + 2 ** -6, 1 + 2 ** -7, -1.0, 3 * 2 ** -9]


@pytest.mark.parametrize("name", ["F32", "BF16"])
def test_float16_of_tiny_values(name):
    """paddle 3.3's CPU float32 -> float16 cast turns 2^-89 <= |x| < 2^-77 into garbage (2.1e-24 ->
    3.9e-5); those must come out as signed zeros, and the edge of float16's subnormals must round
    to nearest even."""
    x = np.array([2.1e-24, -2.1e-24, 2.0 ** -80, -(2.0 ** -88), 1e-30, 2.0 ** -25, -(2.0 ** -25), 3 * 2.0 ** -26,
                  2.0 ** -24, 5 * 2.0 ** -26, 65504, 65520, -1e5, 0.0, -0.0, 1.5], np.float32)
    if name == "BF16":
        x = round_bf16(x)
        raw = (bits(x) >> 16).astype(np.uint16).view(np.uint8)
    else:
        raw = x.view(np.uint8)
    with np.errstate(over="ignore"):
        expect = x.astype(np.float16)
    got = gb.dequantize(paddle.to_tensor(raw.reshape(1, -1)), name, x.size, "float16").numpy()[0]
    assert np.array_equal(got.view(np.uint16), expect.view(np.uint16))
    assert np.signbit(got[[1, 3, 6, 14]]).all() and (got[:7] == 0).all()


@pytest.mark.parametrize("name", ["F32", "BF16", "Q4_1", "Q8_0", "Q6_K"])
def test_views_of_a_bigger_tensor(name):
    """Row slices (contiguous, at an offset), column slices and single rows read their own bytes:
    paddle 3.3's view(dtype) alone would read from the start of the storage."""
    rng = np.random.default_rng(RNG_SEED + 3)
    raw = random_blocks(name, (6, 512), rng)
    whole = paddle.to_tensor(raw)
    full = deq(raw, name, 512)
    assert np.array_equal(bits(gb.dequantize(whole[2:5], name, 512).numpy()), bits(full[2:5]))
    assert np.array_equal(bits(gb.dequantize(whole[3], name, 512).numpy()), bits(full[3]))
    wide = paddle.to_tensor(np.concatenate([raw, raw[::-1]], axis=1))
    half = raw.shape[1]
    assert np.array_equal(bits(gb.dequantize(wide[:, half:], name, 512).numpy()), bits(full[::-1]))
    gathered = paddle.gather(whole, paddle.to_tensor([4, 0, 4]))          # an embedding lookup
    assert np.array_equal(bits(gb.dequantize(gathered, name, 512).numpy()), bits(full[[4, 0, 4]]))


def test_shapes_kept():
    raw = random_blocks("Q4_K", (2, 3, 512), np.random.default_rng(RNG_SEED + 4))
    assert deq(raw, "Q4_K", 512).shape == (2, 3, 512)
    assert deq(raw[0, 0], "Q4_K", 512).shape == (512,)
    assert list(gb.dequantize(paddle.zeros([0, 288], "uint8"), "Q4_K", 512).shape) == [0, 512]
    assert np.array_equal(deq(raw, "Q4_K", 512).reshape(6, 512), deq(raw.reshape(6, -1), "Q4_K", 512))
    fmt = gb.BLOCK_FORMATS["Q4_K"]
    for spec in (fmt, 12, GGMLQuantizationType.Q4_K):      # any way of naming the format
        assert np.array_equal(gb.dequantize(paddle.to_tensor(raw), spec, 512).numpy(), deq(raw, "Q4_K", 512))
    assert np.array_equal(gb.dequantize(raw, "Q4_K", 512).numpy(), deq(raw, "Q4_K", 512))   # numpy bytes too


# --- speed (printed, not asserted) ---------------------------------------------------------------

def _median_ms(fn, runs: int = 7) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@pytest.mark.parametrize(("name", "shape"), [("Q4_1", (1536, 576)), ("Q8_0", (1536, 576)),
                                             ("Q4_K", (576, 1536)), ("Q6_K", (576, 1536))])
def test_dequantize_time(name, shape):
    """A SmolLM2-135M MLP weight (1536 x 576): the portable path dequantizes it every step. The
    K-quants need rows that are a multiple of 256, so they are timed on down_proj's [576, 1536].
    On CPU most of the time here is page faults on each fresh multi-MB result: the engine's cpu
    device turns them off (`fdplug.plugins.cpu.device.keep_freed_memory`, process-wide, so not
    here), which makes these several times faster."""
    raw = paddle.to_tensor(random_blocks(name, shape, np.random.default_rng(RNG_SEED + 5)))
    out = gb.dequantize(raw, name, shape[-1])
    assert list(out.shape) == list(shape)
    ms = _median_ms(lambda: gb.dequantize(raw, name, shape[-1]))
    ms_bf16 = _median_ms(lambda: gb.dequantize(raw, name, shape[-1], "bfloat16"))
    raw_np = raw.numpy()
    ms_np = _median_ms(lambda: quants.dequantize(raw_np, qtype(name)), runs=3)
    print(f"\n{name} {list(shape)} on {paddle.get_device()}: dequantize {ms:.2f} ms median "
          f"(bfloat16 {ms_bf16:.2f} ms; gguf's numpy {ms_np:.2f} ms)")
