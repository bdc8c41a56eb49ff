"""Feature formats: npy and safetensors decode safely, pickle only when allowed, shapes are checked."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct

import numpy as np
import pytest
from safetensors.numpy import save as st_save

from fdplug.core.multimodal.features import (
    decode_feature,
    detect_format,
    validate_feature,
)
from fdplug.errors import FeatureFormatError

URL = "bos://bucket/feats/img_0.bin"


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def safetensors_bytes(dtype: str, shape: tuple[int, ...], raw: bytes, extra: dict | None = None) -> bytes:
    """A safetensors file written by hand, for dtypes numpy cannot produce (BF16) and malformed cases."""
    header = {"feature": {"dtype": dtype, "shape": list(shape), "data_offsets": [0, len(raw)]}, **(extra or {})}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + raw


@pytest.fixture(autouse=True)
def no_pickle(monkeypatch):
    monkeypatch.delenv("FDPLUG_ALLOW_PICKLE_FEATURES", raising=False)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_npy_round_trips(dtype):
    arr = np.arange(12, dtype=dtype).reshape(3, 4)
    out = decode_feature(npy_bytes(arr), URL)
    assert out.dtype == dtype and out.shape == (3, 4)
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_safetensors_from_the_library_round_trips(dtype):
    arr = (np.arange(15, dtype=np.float32).reshape(5, 3) / 7).astype(dtype)
    out = decode_feature(st_save({"x": arr}), URL)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, arr)


def test_safetensors_bf16_becomes_exact_float32():
    values = np.array([[1.5, -2.0, 0.15625], [3.140625, 0.0, -1024.0]], dtype=np.float32)
    bf16_bits = (values.view(np.uint32) >> 16).astype("<u2")  # these values are exact in bf16
    out = decode_feature(safetensors_bytes("BF16", (2, 3), bf16_bits.tobytes()), URL)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, values)


def test_safetensors_with_two_tensors_is_refused():
    data = st_save({"a": np.zeros((1, 2), np.float32), "b": np.zeros((1, 2), np.float32)})
    with pytest.raises(FeatureFormatError, match="2 tensors"):
        decode_feature(data, URL)


def test_truncated_safetensors_is_refused():
    data = safetensors_bytes("F32", (4, 4), np.zeros(16, np.float32).tobytes())[:-8]
    with pytest.raises(FeatureFormatError) as err:
        decode_feature(data, URL)
    assert URL in str(err.value)


def test_pickle_is_refused_by_default_and_never_runs(monkeypatch):
    class Payload:
        def __reduce__(self):
            return exec, ("import os; os.environ['FDPLUG_TEST_PICKLE_RAN'] = '1'",)

    monkeypatch.delenv("FDPLUG_TEST_PICKLE_RAN", raising=False)
    data = pickle.dumps(Payload(), protocol=4)
    with pytest.raises(FeatureFormatError) as err:
        decode_feature(data, "bos://bucket/disguised.npy")  # the extension must not matter
    assert "FDPLUG_ALLOW_PICKLE_FEATURES=1" in str(err.value)
    assert "FDPLUG_TEST_PICKLE_RAN" not in os.environ


def test_pickle_loads_when_allowed(monkeypatch):
    monkeypatch.setenv("FDPLUG_ALLOW_PICKLE_FEATURES", "1")
    arr = np.ones((2, 8), np.float32)
    assert detect_format(pickle.dumps(arr), URL) == "pickle"
    np.testing.assert_array_equal(decode_feature(pickle.dumps(arr), URL), arr)
    np.testing.assert_array_equal(decode_feature(pickle.dumps({"feature": arr}), URL), arr)


@pytest.mark.parametrize("arr", [np.arange(6, dtype=np.int32).reshape(2, 3), np.zeros((2, 3), np.float64)])
def test_non_feature_dtypes_are_refused(arr):
    with pytest.raises(FeatureFormatError, match=str(arr.dtype)):
        decode_feature(npy_bytes(arr), URL)


def npy_written(header: str, raw: bytes, version: int = 1) -> bytes:
    """A .npy file with ``header`` as written, for the spellings other writers use and broken files."""
    text = header.encode("latin-1")
    size = struct.pack("<H", len(text)) if version == 1 else struct.pack("<I", len(text))
    return b"\x93NUMPY" + bytes([version, 0]) + size + text + raw


@pytest.mark.parametrize("arr", [np.arange(12, dtype=np.float32).reshape(3, 4),
                                 np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
                                 np.arange(24, dtype=">f4").reshape(2, 3, 4),
                                 np.zeros((0, 8), np.float16), np.float32(2.5), np.arange(5, dtype="<f2")])
@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_reads_what_numpy_wrote(arr, version):
    """Every layout and header version numpy writes reads as np.load reads it (without numpy's
    parser: `_decode_npy`)."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asanyarray(arr), version=version)
    out = decode_feature(buf.getvalue(), URL)
    want = np.load(io.BytesIO(buf.getvalue()), allow_pickle=False)
    assert out.shape == want.shape and out.dtype == want.dtype.newbyteorder("=")
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("header", ["{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",   # numpy's
                                    "{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}",     # other order
                                    '{"descr": "<f4", "fortran_order": False, "shape": (2L, 3L)}',   # python 2
                                    "{'descr':'<f4','fortran_order':False,'shape':(2,3,),}"])        # no spaces
def test_npy_headers_of_other_writers(header):
    raw = np.arange(6, dtype="<f4").tobytes()
    np.testing.assert_array_equal(decode_feature(npy_written(header + " \n", raw), URL),
                                  np.arange(6, dtype=np.float32).reshape(2, 3))


@pytest.mark.parametrize(("data", "why"), [
    (npy_written("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", b"\0" * 20), "20 bytes of data"),
    (npy_written("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", b"\0" * 8), "plain array"),
    (npy_written("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'extra': 1}", b"\0" * 8), "plain array"),
    (npy_written("{'descr': '<f4', 'fortran_order': False}", b""), "plain array"),
    (npy_written("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", b"", version=9), "version 9"),
    (npy_written("['descr', '<f4']", b""), "not a dict"),
    (b"\x93NUMPY\x01\x00\xff", "ends inside its header"),
    (b"not numpy at all", "magic"),
    (b"\x93NUMPY\x02\x00" + struct.pack("<I", 10**6) + b"{" * 10**6, "header of 1000000 bytes"),
], ids=["truncated", "structured", "extra-key", "no-shape", "version", "list", "short", "magic", "huge-header"])
def test_broken_npy_files_are_refused_by_name(data, why):
    with pytest.raises(FeatureFormatError, match=f"could not be read as npy: .*{why}") as err:
        decode_feature(data, "bos://bucket/feats/img_0.npy")
    assert err.value.fix


def test_npy_is_read_without_the_ast_parser(monkeypatch):
    """np.load parses the header with ast.literal_eval, and CPython 3.11's AST constructor shares its
    recursion count between threads ("AST constructor recursion depth mismatch", cpython gh-106905):
    one suite run in twenty under pytest-xdist lost a feature fetched beside another. The fetch
    threads decode features at once, so the reader must not touch ast (nor np.load) at all."""
    import ast
    import threading

    def forbidden(*args, **kwargs):
        raise AssertionError("the npy reader used ast / np.load")

    monkeypatch.setattr(ast, "literal_eval", forbidden)    # (not ast.parse: pytest reports failures with it)
    monkeypatch.setattr(np, "load", forbidden)
    arrays = [np.arange(4 * (i + 1), dtype=np.float32).reshape(-1, 4) for i in range(8)]
    files = [npy_bytes(a) for a in arrays]
    got: dict[int, np.ndarray | Exception] = {}

    def decode(i: int) -> None:
        try:
            got[i] = decode_feature(files[i], URL)
        except Exception as exc:  # noqa: BLE001 - reported below
            got[i] = exc

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not [v for v in got.values() if isinstance(v, Exception)], got
    assert sorted(got) == list(range(8))
    for i, arr in enumerate(arrays):
        np.testing.assert_array_equal(got[i], arr)


def test_object_npy_is_refused_without_unpickling():
    data = npy_bytes(np.array([{"a": 1}], dtype=object))
    with pytest.raises(FeatureFormatError, match="could not be read as npy"):
        decode_feature(data, URL)


def test_unknown_bytes_name_the_url():
    with pytest.raises(FeatureFormatError) as err:
        decode_feature(b"GIF89a not a feature", URL)
    assert URL in str(err.value) and err.value.url == URL and err.value.fix


def test_validate_feature_names_url_shape_and_hidden_size():
    validate_feature(np.zeros((3, 4), np.float32), URL, 3, 4)
    validate_feature(np.zeros((7, 4), np.float32), URL, None, 4)
    with pytest.raises(FeatureFormatError) as err:
        validate_feature(np.zeros((3, 5), np.float32), URL, 3, 4)
    message = str(err.value)
    assert URL in message and "(3, 5)" in message and "4" in message
    with pytest.raises(FeatureFormatError, match="spans 6 tokens"):
        validate_feature(np.zeros((3, 4), np.float32), URL, 6, 4)
    with pytest.raises(FeatureFormatError, match=r"\(12,\)"):
        validate_feature(np.zeros(12, np.float32), URL, None, 4)
