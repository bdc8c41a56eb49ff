"""The cpu device: always there, the reference every other device is checked against."""

from __future__ import annotations

import ctypes
import os
from types import MappingProxyType

from fdplug.plugin_api.paddle import INSTALL_FIX, import_paddle, paddle_installed
from fdplug.plugin_api.settings import OMP_NUM_THREADS
from fdplug.plugin_api.specs import Probe
from fdplug.plugins.cpu import settings


def usable_cores() -> int:
    """Cores this process may run on (respects taskset/cgroups affinity where the OS reports it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_threads() -> int:
    """Threads CPU compute will use: FDPLUG_CPU_THREADS, else a user's OMP_NUM_THREADS, else every usable core."""
    return settings.CPU_THREADS.value() or OMP_NUM_THREADS.value() or usable_cores()


def is_amd_cpu() -> bool:
    from fdplug.plugins.cpu import isa

    return next((("AuthenticAMD" in line) for line in isa.cpuinfo_lines() if line.startswith("vendor_id")), False)


def probe() -> Probe:
    if not paddle_installed():
        return Probe(False, "PaddlePaddle is not installed", fix=INSTALL_FIX)
    from fdplug.plugins.cpu import isa

    level = isa.describe()
    return Probe(True, f"the CPU is always usable; {level}", info=MappingProxyType(
        {"cores": str(usable_cores()), "threads": str(cpu_threads()), "amd": str(is_amd_cpu()), "isa": level}))


def setup() -> None:
    """Thread count and MKL dispatch, set before the first matrix multiply.

    On AMD CPUs paddle's bundled MKL takes a slow generic path unless ``MKL_DEBUG_CPU_TYPE=5``
    (measured: 1024^3 fp32 matmul on 2 threads, 52 -> 149 GFLOP/s). MKL reads it at its first call,
    so setting it here works even if paddle is already imported. ``import paddle`` sets
    ``OMP_NUM_THREADS=1`` when unset, so the thread count is also set through paddle's API.
    ``KMP_BLOCKTIME=0``: after each parallel op, MKL's OpenMP threads would otherwise spin for
    200 ms, taking the cores the compiled attention kernel's threads need (measured: decode step at
    64 sequences 163 -> 126 ms; the matmuls were not slower).
    """
    if settings.CPU_MALLOC_TUNING.value():
        keep_freed_memory()
    if is_amd_cpu() and not settings.MKL_DEBUG_CPU_TYPE.is_set():
        os.environ["MKL_DEBUG_CPU_TYPE"] = "5"
    if not settings.KMP_BLOCKTIME.is_set():
        os.environ["KMP_BLOCKTIME"] = "0"  # read when the OpenMP runtime starts...
        _set_openmp_blocktime(0)            # ...which paddle ops before this call may already have done
    threads = cpu_threads()
    if not OMP_NUM_THREADS.is_set():
        os.environ["OMP_NUM_THREADS"] = str(threads)
    import_paddle().base.core.set_num_threads(threads)


def _set_openmp_blocktime(ms: int) -> bool:
    """``kmp_set_blocktime`` in the Intel OpenMP runtime paddle ships, if it has one (for the calling thread)."""
    paddle = import_paddle()
    path = os.path.join(os.path.dirname(paddle.__file__), "libs", "libiomp5.so")
    if not os.path.exists(path):
        return False
    try:
        ctypes.CDLL(path).kmp_set_blocktime(ms)
    except (OSError, AttributeError):
        return False
    return True


def keep_freed_memory() -> bool:
    """Make glibc reuse freed memory instead of returning it to the OS and faulting it back in.

    By default glibc serves large blocks with a fresh mmap and unmaps them on free, so every big
    temporary tensor (a gathered KV range, an activation) pays a page fault per 4 KiB. Measured
    here: paddle.gather of 20 MB took 13.7 ms, 2.6 ms with mmap off; a clone 12.5 -> 1.7 ms.
    The cost is that the process keeps its peak heap. Returns False where mallopt is unavailable.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, (1 << 31) - 1))


def free_memory(index: int = 0) -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
