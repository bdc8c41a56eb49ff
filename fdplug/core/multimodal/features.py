"""Pre-encoded multimodal features: bytes from a storage -> a checked ``[num_tokens, hidden_size]`` array.

Safe by default: ``.npy`` (its header read by `_decode_npy`, its data as raw bytes) and
single-tensor ``.safetensors`` are parsed without executing anything. Python pickle, FastDeploy's
format, runs arbitrary code when loaded, so it is refused unless ``FDPLUG_ALLOW_PICKLE_FEATURES=1``:
enable it only when every feature URL comes from a source you trust as much as the server itself.

numpy has no bfloat16, so bf16 features come back as float32 (exact: bf16 is the top half of an
fp32). float16 stays float16; float32 stays float32.
"""

from __future__ import annotations

import json
import pickle
import re
import struct
from math import prod
from typing import Any

import numpy as np

from fdplug.core.settings import env
from fdplug.errors import FeatureFormatError

NPY_MAGIC = b"\x93NUMPY"
PICKLE_PROTO = 0x80  # first byte of every pickle of protocol >= 2
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
_ST_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_FORMAT_FIX = "store features as .npy (np.save) or .safetensors with one float32/bf16/fp16 tensor."


def detect_format(data: bytes, url: str) -> str:
    """``npy``, ``safetensors`` or ``pickle``, from the magic bytes first and the extension second."""
    if data.startswith(NPY_MAGIC):
        return "npy"
    if _looks_like_safetensors(data):
        return "safetensors"
    if data[:1] == bytes([PICKLE_PROTO]):
        return "pickle"
    path = url.split("?", 1)[0].lower()
    for ext, fmt in ((".npy", "npy"), (".safetensors", "safetensors"), (".pkl", "pickle"), (".pickle", "pickle")):
        if path.endswith(ext):
            return fmt
    raise FeatureFormatError(f"feature {url} ({len(data)} bytes) is not .npy, .safetensors or pickle.",
                             url=url, fix=_FORMAT_FIX)


def decode_feature(data: bytes, url: str) -> np.ndarray:
    """The feature array in ``data``, as float32 or float16; raises FeatureFormatError naming ``url``."""
    fmt = detect_format(data, url)
    try:
        if fmt == "npy":
            arr = _decode_npy(data, url)
        elif fmt == "safetensors":
            arr = _decode_safetensors(data, url)
        else:
            arr = _decode_pickle(data, url)
    except FeatureFormatError:
        raise
    except Exception as exc:  # a corrupt file: numpy/pickle raise many types
        raise FeatureFormatError(f"feature {url} could not be read as {fmt}: {type(exc).__name__}: {exc}.",
                                 url=url, fix=_FORMAT_FIX) from None
    return _as_feature_dtype(np.asarray(arr), url)


def validate_feature(arr: np.ndarray, url: str, expected_rows: int | None, hidden_size: int) -> None:
    """Refuse a feature whose shape does not fit its placeholder: ``[expected_rows, hidden_size]``.

    ``expected_rows=None`` checks only the hidden size (the placeholder length is not known yet).
    """
    if arr.ndim != 2 or arr.shape[1] != hidden_size:
        raise FeatureFormatError(
            f"feature {url} has shape {tuple(arr.shape)}, expected [num_tokens, {hidden_size}] "
            f"(hidden_size {hidden_size} of the model).", url=url,
            fix="encode it with the encoder that matches this model, as a 2-D [num_tokens, hidden_size] array.")
    if expected_rows is not None and arr.shape[0] != expected_rows:
        raise FeatureFormatError(
            f"feature {url} has {arr.shape[0]} rows (shape {tuple(arr.shape)}), but its placeholder "
            f"spans {expected_rows} tokens.", url=url,
            fix="make the number of placeholder tokens in the prompt equal the feature's rows.")
    if expected_rows is None and not np.isfinite(arr).all():   # once per piece, before the rows are joined
        raise FeatureFormatError(f"feature {url} has NaN or infinite values.", url=url,
                                 fix="check the encoder's output; features must be finite numbers.")


# ---------------------------------------------------------------------------------------------------
# formats
# ---------------------------------------------------------------------------------------------------


def _looks_like_safetensors(data: bytes) -> bool:
    if len(data) < 10:
        return False
    (size,) = struct.unpack("<Q", data[:8])
    return 2 <= size <= len(data) - 8 and data[8:9] == b"{"


_NPY_ENTRY = re.compile(r"""\s*(['"])(\w+)\1\s*:\s*(?:(['"])([^'"]*)\3|(True|False)|\(([\d\s,L]*)\))\s*(,|(?=\}))""")
_NPY_DESCR = re.compile(r"[<>|=]?[a-zA-Z]\d*")
NPY_MAX_HEADER = 10_000   # bytes, as np.load's max_header_size: a header past it is refused


def _decode_npy(data: bytes, url: str) -> np.ndarray:
    """A ``.npy`` file's array, read without numpy's header parser.

    Why not ``np.load``: it reads the header, a Python dict literal, with ``ast.literal_eval``, and
    CPython 3.11's AST constructor counts its recursion depth in state the interpreter's threads
    share, so two threads parsing at once can fail with ``SystemError: AST constructor recursion
    depth mismatch`` (cpython gh-106905). Features are decoded in the fetch threads, several at
    once: one run of the test suite in twenty under pytest-xdist lost a request that way (a
    ``cat.npy`` fetched beside a ``dog.npy``). The header holds three keys (numpy's format, versions
    1-3: ``descr``, a plain type code such as ``'<f4'``; ``fortran_order``; ``shape``, a tuple of
    ints), read here with a regular expression; anything else (a structured or object dtype) is
    refused by name."""
    def refuse(why: str) -> FeatureFormatError:
        return FeatureFormatError(f"feature {url} could not be read as npy: {why}.", url=url, fix=_FORMAT_FIX)

    if not data.startswith(NPY_MAGIC):
        raise refuse("it does not start with numpy's magic string")
    major = data[6] if len(data) > 7 else 0
    if major not in (1, 2, 3):
        raise refuse(f"npy format version {major} is not 1, 2 or 3")
    size_format, start = ("<H", 10) if major == 1 else ("<I", 12)
    if len(data) < start:
        raise refuse("the file ends inside its header")
    (header_len,) = struct.unpack(size_format, data[8:start])
    if header_len > NPY_MAX_HEADER:
        raise refuse(f"its header of {header_len} bytes is over {NPY_MAX_HEADER}")
    header = data[start:start + header_len].decode("utf-8" if major == 3 else "latin-1").strip()
    if len(data) < start + header_len or not (header.startswith("{") and header.endswith("}")):
        raise refuse("its header is not a dict")
    fields, at = {}, 1
    while at < len(header) - 1 and (entry := _NPY_ENTRY.match(header, at)) is not None:
        quote, text, flag, dims = entry.group(3, 4, 5, 6)   # a string, True/False or a tuple's inside
        fields[entry.group(2)] = text if quote else (flag == "True") if flag else dims
        at = entry.end()
    if header[at:-1].strip() or set(fields) != {"descr", "fortran_order", "shape"}:
        raise refuse(f"its header {header[:200]!r} is not a plain array's (descr, fortran_order, shape)")
    descr, fortran, shape_text = fields["descr"], fields["fortran_order"], fields["shape"]
    if not isinstance(descr, str) or not _NPY_DESCR.fullmatch(descr) or not isinstance(fortran, bool) \
            or not isinstance(shape_text, str):
        raise refuse(f"its header {header[:200]!r} is not a plain array's")
    shape = tuple(int(d.strip().rstrip("L")) for d in shape_text.split(",") if d.strip())
    dtype = np.dtype(descr)
    if dtype.hasobject:
        raise refuse("it holds Python objects")
    count, offset = prod(shape), start + header_len
    if len(data) - offset < count * dtype.itemsize:
        raise refuse(f"{len(data) - offset} bytes of data for shape {shape} of {dtype}")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)


def _decode_safetensors(data: bytes, url: str) -> np.ndarray:
    """Parse the safetensors layout directly: an 8-byte header size, a JSON header, raw tensor bytes."""
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(MAX_SAFETENSORS_HEADER, len(data) - 8):
        raise FeatureFormatError(f"feature {url}: safetensors header size {size} exceeds the file.",
                                 url=url, fix=_FORMAT_FIX)
    header = json.loads(data[8:8 + size])
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if len(tensors) != 1:
        raise FeatureFormatError(f"feature {url}: safetensors file holds {len(tensors)} tensors "
                                 f"({', '.join(sorted(tensors)) or 'none'}), expected exactly one.",
                                 url=url, fix="save one tensor per feature file.")
    (info,) = tensors.values()
    dtype = _ST_DTYPES.get(info.get("dtype"))
    if dtype is None:
        raise FeatureFormatError(f"feature {url}: safetensors dtype {info.get('dtype')} is not supported "
                                 "(F32, BF16, F16 are).", url=url, fix=_FORMAT_FIX)
    start, end = (8 + size + int(o) for o in info["data_offsets"])
    shape = tuple(int(d) for d in info["shape"])
    if not (8 + size <= start <= end <= len(data)) or end - start != dtype.itemsize * int(np.prod(shape)):
        raise FeatureFormatError(f"feature {url}: safetensors offsets {info['data_offsets']} do not match "
                                 f"shape {shape} and the file size {len(data)}.", url=url, fix=_FORMAT_FIX)
    arr = np.frombuffer(data, dtype=dtype, count=int(np.prod(shape)), offset=start).reshape(shape)
    if info["dtype"] == "BF16":
        return bf16_bits_to_float32(arr)
    return arr.astype(dtype.newbyteorder("="), copy=False)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly: bf16 is the high half of an fp32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _decode_pickle(data: bytes, url: str) -> np.ndarray:
    if not env("FDPLUG_ALLOW_PICKLE_FEATURES"):
        raise FeatureFormatError(
            f"feature {url} is a Python pickle, which can run arbitrary code when loaded; it is refused.",
            url=url, fix="convert it to .npy or .safetensors, or, only if every feature source is trusted, "
                         "set FDPLUG_ALLOW_PICKLE_FEATURES=1.")
    return _to_array(pickle.loads(data), url)  # noqa: S301 - opt-in, documented as trusted sources only


def _to_array(obj: Any, url: str) -> np.ndarray:
    """Pickles hold an ndarray, a framework tensor (``.numpy()``), or a dict with one of those."""
    if isinstance(obj, dict) and len(obj) == 1:
        obj = next(iter(obj.values()))
    if hasattr(obj, "numpy") and not isinstance(obj, np.ndarray):
        obj = obj.numpy()
    if isinstance(obj, (np.ndarray, list)):
        return np.asarray(obj)
    raise FeatureFormatError(f"feature {url}: the pickle holds a {type(obj).__name__}, not an array.",
                             url=url, fix="pickle a numpy array (or use .npy).")


def _as_feature_dtype(arr: np.ndarray, url: str) -> np.ndarray:
    if arr.dtype.kind == "f" and arr.dtype.itemsize in (2, 4):
        return arr.astype(arr.dtype.newbyteorder("="), copy=False)
    if arr.dtype.name == "bfloat16":  # ml_dtypes arrays from a pickle
        return arr.astype(np.float32)
    raise FeatureFormatError(f"feature {url} has dtype {arr.dtype}, expected float32, bfloat16 or float16.",
                             url=url, fix="cast the feature to float32, bfloat16 or float16 before saving it.")
