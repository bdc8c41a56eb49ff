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
