"""The cpu device's compiled kernels: built once with the system C compiler, loaded with ctypes.

``csrc/cpu_kernels.c`` holds a paged attention that reads the KV cache in place, the KV write,
SwiGLU, a MoE layer's routed experts, the FP8 linear and the linear layer (see the files for why). It is
compiled the first time it is needed, with ``-march=native``, into ``$FDPLUG_CACHE_DIR/kernels/``
under a name that hashes the sources, the flags, the compiler and the CPU's feature flags: a
changed source or a different CPU gets its own build, and a build from another machine sharing the directory is never loaded. The
build goes to a temporary file that is renamed into place, so concurrent processes never load a
half-written library.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fdplug.errors import ConfigError
from fdplug.plugin_api.settings import cache_dir
from fdplug.plugins.cpu import settings

logger = logging.getLogger("fdplug")

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "cpu_kernels.c"    # it #includes the other files of CSRC
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared", "-pthread", "-std=c99")
ABI = 5
BUILD_TIMEOUT_S = 120.0

_c_int, _c_float, _ptr = ctypes.c_int, ctypes.c_float, ctypes.c_void_p


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
    lines = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    lines.append(line.strip())
                if len(lines) >= 2:
                    break
    except OSError:
        pass
    return "\n".join(lines) or platform.processor() or platform.machine()


def library_path(cc: list[str]) -> Path:
    key = hashlib.sha256()
    included = (f.read_bytes() for f in sorted(CSRC.glob("*.c")) if f != SOURCE)
    for part in (SOURCE.read_bytes(), *included, " ".join(FLAGS).encode(), " ".join(cc).encode(), _cpu_fingerprint().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / "kernels" / f"cpu_kernels-{platform.machine()}-{key.hexdigest()[:16]}.so"


def build(cc: list[str], target: Path) -> None:
    """Compile the source into ``target`` (atomically). Raises KernelsUnavailable with the compiler's words."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        try:
            command = [*cc, *FLAGS, "-I", str(CSRC), "-o", tmp, str(SOURCE), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise KernelsUnavailable(f"the C compiler {cc[0]!r} could not run: {exc}") from None
        if result.returncode != 0:
            words = (result.stderr or result.stdout).strip().splitlines()[-5:]
            raise KernelsUnavailable(f"{cc[0]} failed (exit {result.returncode}): " + " | ".join(words))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def load() -> ctypes.CDLL:
    """The kernel library, built on first use. Raises KernelsUnavailable (cached per process)."""
    if mode() == "off":
        raise KernelsUnavailable("FDPLUG_CPU_KERNELS=off")
    cc = compiler()
    if cc is None:
        raise KernelsUnavailable("no C compiler found (set CC, or install gcc or clang)")
    path = library_path(cc)
    if not path.exists():
        logger.info("building the cpu kernels with %s into %s", cc[0], path)
        build(cc, path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelsUnavailable(f"{path} does not load: {exc}") from None
    if lib.fdplug_kernels_abi() != ABI:
        raise KernelsUnavailable(f"{path} has ABI {lib.fdplug_kernels_abi()}, expected {ABI}")
    attention = lib.fdplug_paged_attention
    attention.restype, attention.argtypes = _c_int, [_ptr] * 8 + [_c_int] * 8 + [_c_float, _c_int]
    lib.fdplug_write_kv.restype, lib.fdplug_write_kv.argtypes = None, [_ptr] * 5 + [_c_int] * 3 + [ctypes.c_int64]
    lib.fdplug_swiglu.restype, lib.fdplug_swiglu.argtypes = None, [_ptr, _ptr, ctypes.c_int64, _c_int, _c_int]
    lib.fdplug_moe_pack.restype, lib.fdplug_moe_pack.argtypes = None, [_ptr] * 5 + [_c_int] * 4
    lib.fdplug_moe_experts.restype, lib.fdplug_moe_experts.argtypes = _c_int, [_ptr] * 6 + [_c_int] * 6
    lib.fdplug_fp8_linear.restype, lib.fdplug_fp8_linear.argtypes = None, [_ptr] * 4 + [_c_int] * 5
    lib.fdplug_fp8_moe.restype, lib.fdplug_fp8_moe.argtypes = _c_int, [_ptr] * 8 + [_c_int] * 7
    lib.fdplug_linear.restype, lib.fdplug_linear.argtypes = None, [_ptr, _ptr, _c_int, _ptr] + [_c_int] * 4
    lib.fdplug_prefill_attention.restype, lib.fdplug_prefill_attention.argtypes = _c_int, [_ptr] * 7 + [_c_int] * 7 + [_c_float, _c_int]
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
        if str(t.dtype) != "paddle.float32":
            raise TypeError(f"the cpu kernels compute in float32, got {t.dtype}")


def _contiguous(t: Any) -> Any:
    return t if t.is_contiguous() else t.contiguous()


def paged_attention(q: Any, key_cache: Any, value_cache: Any, q_rows: np.ndarray, block_tables: np.ndarray,
                    seq_of_token: np.ndarray, key_end: np.ndarray, scale: float, threads: int) -> Any:
    """``[len(q_rows), heads, dim]``: each row's attention over keys ``[0, key_end)`` of its block table row.

    The int arrays are int32 and C-contiguous (the backend's ``prepare`` builds them once per step
    and checks every block id and key count against the cache, so the C code can trust them).
    """
    import paddle

    lib = load()
    q = _contiguous(q)
    _check_float32(q, key_cache, value_cache)
    num_tokens, heads, dim = q_rows.shape[0], q.shape[1], q.shape[2]
    kv_heads, num_blocks, block_size, _ = key_cache.shape
    out = paddle.empty([num_tokens, heads, dim], dtype="float32")
    status = lib.fdplug_paged_attention(
        q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), q_rows.ctypes.data, block_tables.ctypes.data,
        seq_of_token.ctypes.data, key_end.ctypes.data, out.data_ptr(), num_tokens, heads, kv_heads, dim,
        num_blocks, block_size, block_tables.shape[1], int(key_end.max()) if num_tokens else 1, scale, threads)
    if status != 0:
        raise MemoryError("cpu paged attention could not allocate its scratch memory or start its threads")
    return out


def write_kv(key: Any, value: Any, key_cache: Any, value_cache: Any, slots: np.ndarray) -> None:
    """``cache[h, slot] = new[t, h]`` for both caches; ``slots`` int64, checked by the caller."""
    key, value = _contiguous(key), _contiguous(value)
    _check_float32(key, value, key_cache, value_cache)
    kv_heads, num_blocks, block_size, dim = key_cache.shape
    load().fdplug_write_kv(key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                           slots.ctypes.data, slots.shape[0], kv_heads, dim, num_blocks * block_size)


# Below this many outputs one thread is faster than starting another (a decode step's few rows).
SWIGLU_MIN_PARALLEL = 1 << 15
# Below this many, paddle's own loop beats this call's fixed cost (~50 us of ctypes and allocation).
SWIGLU_MIN_OUTPUTS = 1 << 13


def swiglu(x: Any, threads: int) -> Any:
    """``silu(x[..., :n]) * x[..., n:]`` with ``n = x.shape[-1] // 2``: paddle's ``F.swiglu`` contract."""
    import paddle
    import paddle.nn.functional as F

    if x.size < 2 * SWIGLU_MIN_OUTPUTS:
        return F.swiglu(x)
    x = _contiguous(x)
    _check_float32(x)
    *lead, width = x.shape
    if width % 2:
        raise ValueError(f"swiglu needs an even last dimension, got {width}")
    rows, inter = int(np.prod(lead)), width // 2
    out = paddle.empty([*lead, inter], dtype="float32")
    parallel = threads if rows * inter >= SWIGLU_MIN_PARALLEL else 1
    load().fdplug_swiglu(x.data_ptr(), out.data_ptr(), rows, inter, parallel)
    return out


@dataclass(frozen=True, slots=True)
class PackedExperts:
    """One layer's routed experts in the layout ``fdplug_moe_experts`` reads (see the C file).

    ``gate_up`` [E, 2*I*H]: per expert, panels of 8 intermediate columns, each ``[H][8 gate | 8 up]``
    (the last panel narrower when I is not a multiple of 8). ``down`` [E, H*I]: per expert, panels
    of 16 output columns, each ``[I][16]`` (the last one narrower). Exactly the inputs' floats.
    """

    gate_up: Any
    down: Any
    num_experts: int
    hidden: int
    inter: int


def pack_experts(gate: Any, up: Any, down: Any, threads: int = 1) -> PackedExperts:
    """One layer's experts (``gate``, ``up`` [E, I, H], ``down`` [E, H, I], float32) repacked, at load time.

    The result holds new tensors only (as many bytes as the inputs, which it does not keep).
    """
    import paddle

    lib = load()
    gate, up, down = _contiguous(gate), _contiguous(up), _contiguous(down)
    _check_float32(gate, up, down)
    if len(gate.shape) != 3 or list(up.shape) != list(gate.shape):
        raise ValueError(f"gate and up must both be [E, I, H], got {list(gate.shape)} and {list(up.shape)}")
    experts, inter, hidden = (int(n) for n in gate.shape)
    if list(down.shape) != [experts, hidden, inter]:
        raise ValueError(f"down must be [E, H, I] = {[experts, hidden, inter]}, got {list(down.shape)}")
    if min(experts, inter, hidden) <= 0 or 2 * inter * hidden >= 2**31:
        raise ValueError(f"unsupported expert shape E={experts} I={inter} H={hidden}")
    gate_up = paddle.empty([experts, 2 * inter * hidden], dtype="float32")
    packed_down = paddle.empty([experts, hidden * inter], dtype="float32")
    lib.fdplug_moe_pack(gate.data_ptr(), up.data_ptr(), down.data_ptr(), gate_up.data_ptr(), packed_down.data_ptr(),
                        experts, hidden, inter, max(1, threads))
    return PackedExperts(gate_up, packed_down, experts, hidden, inter)


def moe_experts(x: Any, packed: PackedExperts, topk_ids: np.ndarray, topk_weights: np.ndarray,
                threads: int) -> Any:
    """``out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t)``, ``e = topk_ids[t, k]``.

    ``x`` [T, H] float32; ``topk_ids`` int32 and ``topk_weights`` [T, K]. Each token's row is the
    same, bit for bit, whatever else is in the batch and however many threads run it. An id outside
    ``[0, E)`` is a ValueError (checked in C before anything is read through it).
    """
    import paddle

    x = _contiguous(x)
    _check_float32(x)
    if len(x.shape) != 2 or int(x.shape[1]) != packed.hidden:
        raise ValueError(f"x must be [T, {packed.hidden}], got {x.shape}")
    ids = np.asarray(topk_ids)
    if ids.dtype != np.int32:
        raise TypeError(f"topk_ids must be int32, got {ids.dtype}")
    ids = np.ascontiguousarray(ids)
    weights = np.ascontiguousarray(topk_weights, dtype=np.float32)
    tokens = int(x.shape[0])
    if ids.ndim != 2 or ids.shape[0] != tokens or weights.shape != ids.shape or ids.shape[1] < 1:
        raise ValueError(f"topk_ids and topk_weights must both be [{tokens}, K], got {ids.shape} and {weights.shape}")
    out = paddle.empty([tokens, packed.hidden], dtype="float32")
    if tokens == 0:
        return out
    status = load().fdplug_moe_experts(
        x.data_ptr(), packed.gate_up.data_ptr(), packed.down.data_ptr(), ids.ctypes.data, weights.ctypes.data,
        out.data_ptr(), tokens, ids.shape[1], packed.num_experts, packed.hidden, packed.inter, threads)
    if status == -2:
        bad = ids[(ids < 0) | (ids >= packed.num_experts)]
        raise ValueError(f"expert id {int(bad[0])} is outside [0, {packed.num_experts})")
    if status != 0:
        raise MemoryError("the cpu MoE kernel could not allocate its scratch memory")
    return out
