"""The cpu device's compiled kernels: built once with the system C compiler (`kernel_build`), loaded with ctypes.

``csrc/cpu_kernels.c`` holds a paged attention that reads the KV cache in place, the KV write,
SwiGLU, RMSNorm (alone and with the residual add), RoPE, a MoE layer's routed experts, the FP8
linear, the linear layer and the GGUF linear (see the files for why). The library, or the reason
it is unavailable, is kept for the process: a failed build is not tried again on every call.

``FDPLUG_CPU_KERNELS``: ``auto`` uses them when they build, ``on`` makes a failed build an error,
``off`` keeps the plain-Paddle reference. ctypes releases the GIL for the call; the kernel spreads
its work over ``cpu_threads()`` threads of its own.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from fdplug.errors import ConfigError
from fdplug.plugins.cpu import settings
from fdplug.plugins.cpu.kernel_build import KernelsUnavailable, build_once, compiler, library_path

ABI = 12

_c_int, _c_float, _ptr, _i64 = ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {   # (restype, argtypes) of every function the library exports (csrc/)
    "fdplug_paged_attention": (_c_int, [_ptr] * 8 + [_c_int] * 8 + [_c_float, _c_int, _c_int]),
    "fdplug_write_kv": (None, [_ptr] * 5 + [_c_int] * 3 + [_i64, _c_int]),
    "fdplug_swiglu": (None, [_ptr, _ptr, _i64, _c_int, _c_int]),
    "fdplug_moe_pack": (None, [_ptr] * 5 + [_c_int] * 4),
    "fdplug_moe_experts": (_c_int, [_ptr] * 6 + [_c_int] * 6),
    "fdplug_moe_scratch_bytes": (_i64, [_i64]),
    "fdplug_fp8_linear": (None, [_ptr] * 4 + [_c_int] * 5),
    "fdplug_fp8_moe": (_c_int, [_ptr] * 8 + [_c_int] * 7),
    "fdplug_fp8_dequant": (None, [_ptr] * 3 + [_c_int] * 4),
    "fdplug_linear": (None, [_ptr, _ptr, _c_int, _ptr] + [_c_int] * 4),
    "fdplug_linear_bf16dot": (_c_int, [_ptr] * 3 + [_c_int] * 4),
    "fdplug_linear_bf16dot_available": (_c_int, []),
    "fdplug_linear_packed": (_c_int, [_ptr, _ptr, _c_int, _ptr, _ptr] + [_c_int] * 4),
    "fdplug_linear_packed_fp8": (_c_int, [_ptr] * 5 + [_c_int] * 5),
    "fdplug_linear_packed_panel": (_c_int, []),
    "fdplug_prefill_attention": (_c_int, [_ptr] * 7 + [_c_int] * 7 + [_c_float, _c_int, _c_int]),
    "fdplug_prefill_attention_available": (_c_int, []),
    "fdplug_rms_norm": (None, [_ptr] * 3 + [_i64, _c_int, _c_int, _c_float, _c_int]),
    "fdplug_add_rms_norm": (None, [_ptr] * 5 + [_i64, _c_int, _c_float, _c_int]),
    "fdplug_rope": (None, [_ptr] * 4 + [_i64, _c_int, _c_int]),
    "fdplug_argmax": (None, [_ptr, _ptr, _i64, _c_int, _c_int]),
    "fdplug_gguf_linear": (_c_int, [_ptr] * 3 + [_c_int] * 5),
    "fdplug_gguf_linear_bf16": (_c_int, [_ptr] * 3 + [_c_int] * 5),
    "fdplug_gguf_bf16_available": (_c_int, []),
    "fdplug_gguf_linear_q8": (_c_int, [_ptr] * 3 + [_c_int] * 5),
    "fdplug_gguf_q8_available": (_c_int, []),
    "fdplug_gguf_linear_packed": (_c_int, [_ptr] * 3 + [_c_int] * 6),
    "fdplug_gguf_packed_available": (_c_int, []),
    "fdplug_gguf_packed_vnni": (_c_int, []),
    "fdplug_gguf_pack": (_c_int, [_ptr] * 2 + [_c_int] * 3),
    "fdplug_gguf_packed_rows": (_c_int, [_ptr, _ptr, _c_int, _ptr] + [_c_int] * 3),
    "fdplug_gguf_dequant": (_c_int, [_ptr] * 2 + [_c_int] * 4),
    "fdplug_decoder_stack": (_c_int, [_ptr] * 2),
    "fdplug_decoder_stack_scratch": (_i64, [_ptr, _c_int]),
    "fdplug_fma_peak": (ctypes.c_double, [ctypes.c_double, _c_int]),
}


def mode() -> str:
    return settings.CPU_KERNELS.value()


_failure: str | None = None   # why the kernels are unavailable, once a load has failed in this process


@functools.cache
def load() -> ctypes.CDLL:
    """The kernel library, built on first use (a cache hit on every later call: the kernels' hot
    path). Raises KernelsUnavailable; a failure is kept for the process too (`forget` drops both),
    so a failed build is not tried again on every call."""
    global _failure
    if _failure is not None:
        raise KernelsUnavailable(_failure)
    try:
        return _load()
    except KernelsUnavailable as exc:
        _failure = str(exc)
        raise


def forget() -> None:
    """Drop the loaded library or remembered failure: the next `load` looks (and builds) again."""
    global _failure
    _failure = None
    load.cache_clear()


def _load() -> ctypes.CDLL:
    if mode() == "off":
        raise KernelsUnavailable("FDPLUG_CPU_KERNELS=off")
    cc = compiler()
    if cc is None:
        raise KernelsUnavailable("no C compiler found (set CC, or install gcc or clang)")
    path = library_path(cc)
    if not path.exists():
        build_once(cc, path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelsUnavailable(f"{path} does not load: {exc}") from None
    if lib.fdplug_kernels_abi() != ABI:
        raise KernelsUnavailable(f"{path} has ABI {lib.fdplug_kernels_abi()}, expected {ABI}")
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


def unavailable_reason() -> str | None:
    """None if the kernels load here; else why not (never raises)."""
    try:
        load()
        return None
    except KernelsUnavailable as exc:
        return str(exc)


def require() -> None:
    """With FDPLUG_CPU_KERNELS=on, a ConfigError if the kernels do not load."""
    reason = unavailable_reason() if mode() == "on" else None
    if reason is not None:
        raise ConfigError(f"FDPLUG_CPU_KERNELS=on but the cpu kernels are unavailable: {reason}.",
                          fix="install a C compiler (gcc or clang) or set CC; or set FDPLUG_CPU_KERNELS=auto to "
                              "fall back to plain Paddle when they cannot build.")


def _check_float32(*tensors: Any) -> None:
    for t in tensors:
        if not is_float32(t):
            raise TypeError(f"the cpu kernels compute in float32, got {t.dtype}")


KV_TYPES = ("float32", "float16", "bfloat16")
"""The KV cache's element types the kernels read and write (csrc/kv_elements.c's ids, in order)."""


def kv_type(key_cache: Any, value_cache: Any) -> int:
    """csrc/kv_elements.c's id of the caches' element type (both the same, one of `KV_TYPES`)."""
    name = str(key_cache.dtype).removeprefix("paddle.")
    if name not in KV_TYPES or value_cache.dtype != key_cache.dtype:
        raise TypeError(f"the cpu kernels read KV caches of {', '.join(KV_TYPES)}, got {key_cache.dtype} and "
                        f"{value_cache.dtype}")
    return KV_TYPES.index(name)


@dataclass(frozen=True, slots=True)
class PaddleParts:
    """What the wrappers below ask paddle for on every call, looked up once (`paddle_parts`)."""

    float32: Any
    bfloat16: Any
    uint8: Any
    float8_e4m3fn: Any
    place: Any     # paddle.CPUPlace()
    empty: Any     # paddle._C_ops.empty(shape, dtype, place)


@functools.cache
def paddle_parts() -> PaddleParts:
    import paddle
    from paddle import _C_ops

    return PaddleParts(paddle.float32, paddle.bfloat16, paddle.uint8, paddle.float8_e4m3fn, paddle.CPUPlace(),
                       _C_ops.empty)


def is_dtype(dtype: Any, wanted: Any) -> bool:
    """``dtype == wanted``, by identity first: paddle's dtypes are singletons, and their ``==`` costs
    1.3-1.8 us against 0.2-0.4 for ``is`` (AMD EPYC, avx2-or-less); a decode step checks a few
    hundred of them (every op's input and weight)."""
    return dtype is wanted or dtype == wanted


def is_float32(t: Any) -> bool:
    """Whether tensor ``t`` is float32 (`is_dtype`)."""
    return is_dtype(t.dtype, paddle_parts().float32)


def empty_f32(shape: list[int]) -> Any:
    """An uninitialised float32 host tensor for a kernel's output. Paddle's C op directly: a decode
    step allocates ~330 of these, and ``paddle.empty``'s argument handling cost 3.1 us of the 4.5
    (measured, a Zen 5); the op, dtype and place looked up once more: 5.0 -> 3.5 us a call (AMD
    EPYC, avx2-or-less)."""
    parts = paddle_parts()
    return parts.empty(shape, parts.float32, parts.place)


def _rows(shape: list[int]) -> int:
    """The product of all but the last dimension (no numpy: called several times a layer)."""
    rows = 1
    for size in shape[:-1]:
        rows *= size
    return rows


def _contiguous(t: Any) -> Any:
    return t if t.is_contiguous() else t.contiguous()


def paged_attention(q: Any, key_cache: Any, value_cache: Any, q_rows: np.ndarray, block_tables: np.ndarray,
                    seq_of_token: np.ndarray, key_end: np.ndarray, max_key_end: int, scale: float,
                    threads: int) -> Any:
    """``[len(q_rows), heads, dim]``: each row's attention over keys ``[0, key_end)`` of its block table row
    (``max_key_end`` is ``key_end.max()``, which the backend computes once a step).

    The int arrays are int32 and C-contiguous (the backend's ``prepare`` builds them once per step
    and checks every block id and key count against the cache, so the C code can trust them).
    """

    lib = load()
    q = _contiguous(q)
    _check_float32(q)
    kt = kv_type(key_cache, value_cache)
    num_tokens, heads, dim = q_rows.shape[0], q.shape[1], q.shape[2]
    kv_heads, num_blocks, block_size, _ = key_cache.shape
    out = empty_f32([num_tokens, heads, dim])
    status = lib.fdplug_paged_attention(
        q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), q_rows.ctypes.data, block_tables.ctypes.data,
        seq_of_token.ctypes.data, key_end.ctypes.data, out.data_ptr(), num_tokens, heads, kv_heads, dim,
        num_blocks, block_size, block_tables.shape[1], max_key_end if num_tokens else 1, scale, threads, kt)
    if status != 0:
        raise MemoryError("cpu paged attention could not allocate its scratch memory or start its threads")
    return out


def write_kv(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: np.ndarray) -> None:
    """``cache[h, slot] = new[t, h]`` for both caches; ``slots`` int64, checked by the caller."""
    key, value = _contiguous(key), _contiguous(value)
    _check_float32(key, value)
    kt = kv_type(key_cache, value_cache)
    kv_heads, num_blocks, block_size, dim = key_cache.shape
    load().fdplug_write_kv(key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                           slots.ctypes.data, slots.shape[0], kv_heads, dim, num_blocks * block_size, kt)


# Below this many outputs one thread is faster than starting another (a decode step's few rows).
SWIGLU_MIN_PARALLEL = 1 << 15


def swiglu(x: Any, threads: int) -> Any:
    """``silu(x[..., :n]) * x[..., n:]`` with ``n = x.shape[-1] // 2``: paddle's ``F.swiglu`` contract.

    Every size goes to C: with the thread pool and this wrapper's plain attribute reads the call
    costs a few microseconds (small inputs went to paddle's op while a call cost ~50 us)."""
    shape = x.shape
    width = shape[-1]
    if width % 2:
        raise ValueError(f"swiglu needs an even last dimension, got {width}")
    if not is_float32(x):
        raise TypeError(f"the cpu kernels compute in float32, got {x.dtype}")
    x = _contiguous(x)
    rows, inter = _rows(shape), width // 2
    out = empty_f32([*shape[:-1], inter])
    load().fdplug_swiglu(x.data_ptr(), out.data_ptr(), rows, inter,
                         threads if rows * inter >= SWIGLU_MIN_PARALLEL else 1)
    return out
