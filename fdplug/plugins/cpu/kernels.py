"""The cpu device's compiled kernels: built once with the system C compiler, loaded with ctypes.

``csrc/cpu_kernels.c`` holds a paged attention that reads the KV cache in place, the KV write,
SwiGLU, RMSNorm (alone and with the residual add), RoPE, a MoE layer's routed experts, the FP8
linear, the linear layer and the GGUF linear (see the files for why). It is compiled the first time it is needed,
with ``-march=native`` (or for the level ``FDPLUG_CPU_ISA`` caps it to: `isa`), into
``$FDPLUG_CACHE_DIR/kernels/`` under a name that hashes the sources, the flags, the compiler and
the CPU's feature flags: a changed source or a different CPU gets its own build, and a build from
another machine sharing the directory is never loaded. The build goes
to a temporary file that is renamed into place, so concurrent processes never load a half-written
library; a file lock makes concurrent processes (an API process and its engines, DP ranks, a test
suite's servers) wait for one build instead of each compiling at once. GCC compiles the one
translation unit in parallel (``-flto=auto``: its code generation, ~95% of the time, split over the
cores): on an AMD EPYC Zen 3 core a build takes ~2 minutes plain, ~1.2 with both of 2 cores. A failed
build is remembered for the process (no second attempt per call).

``FDPLUG_CPU_KERNELS``: ``auto`` uses them when they build, ``on`` makes a failed build an error,
``off`` keeps the plain-Paddle reference. ctypes releases the GIL for the call; the kernel spreads
its work over ``cpu_threads()`` threads of its own.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from fdplug.core.file_lock import lock_within
from fdplug.errors import ConfigError
from fdplug.plugin_api.settings import cache_dir
from fdplug.plugins.cpu import isa, settings

logger = logging.getLogger("fdplug")

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "cpu_kernels.c"    # it #includes the other files of CSRC
FLAGS = ("-O3", "-fno-math-errno", "-fPIC", "-shared", "-pthread", "-std=c99")   # + the target (`isa.march`)
ABI = 12
BUILD_TIMEOUT_S = 900.0   # one build: ~2 min on a Zen 3 core (measured), several times that on a loaded machine

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
    "fdplug_gguf_dequant": (_c_int, [_ptr] * 2 + [_c_int] * 4),
    "fdplug_decoder_stack": (_c_int, [_ptr] * 2),
    "fdplug_decoder_stack_scratch": (_i64, [_ptr, _c_int]),
}


class KernelsUnavailable(RuntimeError):
    """The compiled kernels cannot be used here; the message says why."""


def mode() -> str:
    return settings.CPU_KERNELS.value()


def compiler() -> list[str] | None:
    """``$CC`` (split like a shell would), else the first of cc, gcc, clang on PATH."""
    configured = settings.CC.value()
    if configured:
        return shlex.split(configured)
    found = next((shutil.which(name) for name in ("cc", "gcc", "clang") if shutil.which(name)), None)
    return [found] if found else None


def _cpu_fingerprint() -> str:
    """The CPU model and feature flags: -march=native code is only valid where these match."""
    lines = [line for line in isa.cpuinfo_lines() if line.startswith(("model name", "flags", "Features"))][:2]
    return "\n".join(lines) or platform.processor() or platform.machine()


def _flags() -> tuple[str, ...]:
    """The compiler's flags: the target first, so that a flag added to FLAGS (a test's -march) overrides it."""
    return (*isa.march(), *FLAGS)


@functools.lru_cache(maxsize=8)
def parallel_flags(cc: tuple[str, ...]) -> tuple[str, ...]:
    """``("-flto=auto",)`` where ``cc`` is GCC 10 or later, else nothing. With it GCC splits the one
    translation unit's code generation into partitions compiled on every core (`-flto=auto`, GCC 10+);
    the same source and flags, so the same arithmetic (the tiles are inlined within each partition)."""
    try:
        about = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
        version = subprocess.run([*cc, "-dumpfullversion"], capture_output=True, text=True, timeout=30,
                                 check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ()
    major = version.split(".")[0]
    return ("-flto=auto",) if "Free Software Foundation" in about and major.isdigit() and int(major) >= 10 else ()


def library_path(cc: list[str]) -> Path:
    key = hashlib.sha256()
    included = (f.read_bytes() for f in sorted(CSRC.glob("*.c")) if f != SOURCE)
    flags = " ".join((*_flags(), *parallel_flags(tuple(cc))))
    for part in (SOURCE.read_bytes(), *included, flags.encode(), " ".join(cc).encode(), _cpu_fingerprint().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / "kernels" / f"cpu_kernels-{platform.machine()}-{key.hexdigest()[:16]}.so"


def _compile(cc: list[str], extra: tuple[str, ...], tmp: str) -> subprocess.CompletedProcess:
    command = [*cc, *_flags(), *extra, "-I", str(CSRC), "-o", tmp, str(SOURCE), "-lm"]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelsUnavailable(f"the C compiler {cc[0]!r} could not run: {exc}") from None


def build(cc: list[str], target: Path) -> None:
    """Compile the source into ``target`` (atomically), in parallel where the compiler can
    (`parallel_flags`; if that build fails, once more without). Raises KernelsUnavailable with the
    compiler's words."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        parallel = parallel_flags(tuple(cc))
        result = _compile(cc, parallel, tmp)
        if result.returncode != 0 and parallel:
            logger.warning("the parallel build of the cpu kernels failed; building them again without %s",
                           " ".join(parallel))
            result = _compile(cc, (), tmp)
        if result.returncode != 0:
            words = (result.stderr or result.stdout).strip().splitlines()[-5:]
            raise KernelsUnavailable(f"{cc[0]} failed (exit {result.returncode}): " + " | ".join(words))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_once(cc: list[str], path: Path) -> None:
    """``path`` built unless it exists, by one process of the machine at a time: the others wait for
    its build (within `BUILD_TIMEOUT_S`), then find it there. Raises KernelsUnavailable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a+") as lock:
        if lock_within(lock, BUILD_TIMEOUT_S + 60) is False:
            raise KernelsUnavailable(f"another process has been building {path.name} for over "
                                     f"{BUILD_TIMEOUT_S + 60:.0f} s")
        if path.exists():   # built by the process that held the lock
            return
        logger.info("building the cpu kernels with %s into %s (once for this CPU and source: a minute or two)",
                    cc[0], path)
        start = time.monotonic()
        build(cc, path)
        logger.info("built the cpu kernels in %.0f s", time.monotonic() - start)


@functools.cache
def _load_or_failure() -> ctypes.CDLL | KernelsUnavailable:
    try:
        return _load()
    except KernelsUnavailable as exc:
        return exc


def load() -> ctypes.CDLL:
    """The kernel library, built on first use. Raises KernelsUnavailable; the library or the failure
    is kept for the process (`forget` drops it), so a failed build is not tried again on every call."""
    lib = _load_or_failure()
    if isinstance(lib, KernelsUnavailable):
        raise KernelsUnavailable(str(lib))
    return lib


def forget() -> None:
    """Drop the loaded library or remembered failure: the next `load` looks (and builds) again."""
    _load_or_failure.cache_clear()


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
    import paddle

    for t in tensors:
        if t.dtype != paddle.float32:
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


@functools.cache
def _float32_and_place() -> tuple[Any, Any]:
    import paddle

    return paddle.float32, paddle.CPUPlace()


def empty_f32(shape: list[int]) -> Any:
    """An uninitialised float32 host tensor for a kernel's output. Paddle's C op directly: a decode
    step allocates ~330 of these, and ``paddle.empty``'s argument handling cost 3.1 us of the 4.5
    (measured, this Zen 5): ~0.5 ms a token."""
    from paddle import _C_ops

    dtype, place = _float32_and_place()
    return _C_ops.empty(shape, dtype, place)


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
    import paddle

    shape = x.shape
    width = shape[-1]
    if width % 2:
        raise ValueError(f"swiglu needs an even last dimension, got {width}")
    if x.dtype != paddle.float32:
        raise TypeError(f"the cpu kernels compute in float32, got {x.dtype}")
    x = _contiguous(x)
    rows, inter = _rows(shape), width // 2
    out = paddle.empty([*shape[:-1], inter], dtype="float32")
    load().fdplug_swiglu(x.data_ptr(), out.data_ptr(), rows, inter,
                         threads if rows * inter >= SWIGLU_MIN_PARALLEL else 1)
    return out
