"""Ask the kernel to let the engine process's threads preempt the API process on the shared cores.

Why: on a CPU device the engine's compute threads (paddle's MKL/OpenMP workers) and the API process
share the same few cores. A parallel matmul waits for its slowest worker; a worker woken onto the
core where the API process is writing a burst of SSE chunks queues behind it for up to a scheduler
slice (1.4 ms here), and the whole step waits. Measured on this 2-core machine (``bench/serve.py
--repeat 5``, median server/offline throughput): 88.9% with the kernel's slice, 90.8% and 92.8% with
the engine's at 0.1 ms; with the engine on one thread the server matched offline (102.7%), so the
gap was these collisions. On a GPU the engine's busy thread is the one that feeds the device, and
the same rule keeps it from waiting behind the API process.

Linux 6.12+ (EEVDF) lets a normal task ask for a shorter slice (``sched_setattr`` with
``sched_runtime``): its deadline comes sooner, so it preempts on wake-up, while its CPU share is
unchanged, so the API process is never starved (unlike ``nice`` or ``SCHED_IDLE``: the first changed
nothing measurable, the second took p99 TTFT at half load from 33 to 114 ms). Threads inherit the
slice, so setting it before the model is built covers every worker. Older kernels, other systems and
real-time policies are left as they are; the function says so instead of pretending.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys

# sched_setattr(2): x86-64 has its own number; arm64 and riscv64 use the generic table
_SYSCALL_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274, "arm64": 274, "riscv64": 274}
_FAIR_POLICIES = (os.SCHED_OTHER, getattr(os, "SCHED_BATCH", 3)) if hasattr(os, "SCHED_OTHER") else ()


def current_slice_ns(sched_file: str = "/proc/thread-self/sched") -> int | None:
    """A thread's scheduler slice (default: the caller's), or None where the kernel reports none (pre-EEVDF)."""
    try:
        with open(sched_file) as f:
            for line in f:
                if line.startswith("se.slice"):
                    return int(line.split(":")[1])
    except (OSError, ValueError):
        pass
    return None


def shorten_scheduler_slice(slice_us: int) -> tuple[int | None, str]:
    """Set the calling thread's slice (inherited by threads and processes it starts later).

    Returns ``(slice_ns, why)``: the slice now in effect (None where unknown) and a phrase for the log.
    The thread's policy and nice value are kept: ``sched_setattr`` sets all three at once.
    """
    before = current_slice_ns()
    if slice_us == 0:
        return before, "the kernel's default (FDPLUG_ENGINE_SLICE_US=0)"
    number = _SYSCALL_SCHED_SETATTR.get(platform.machine())
    if sys.platform != "linux" or number is None or before is None:
        return before, "unchanged: needs Linux with the EEVDF scheduler (6.6+; custom slices from 6.12)"
    policy = os.sched_getscheduler(0)
    if policy not in _FAIR_POLICIES:
        return before, f"unchanged: the process runs under scheduling policy {policy}, not a fair one"
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    # struct sched_attr, first version (48 bytes): size, policy, flags, nice, priority, runtime, deadline, period
    attr = struct.pack("=IIQiIQQQ", 48, policy, 0, nice, 0, slice_us * 1000, 0, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, 0, ctypes.create_string_buffer(attr, len(attr)), 0) != 0:
        return before, f"unchanged: sched_setattr failed ({os.strerror(ctypes.get_errno())})"
    after = current_slice_ns()
    if after == before and after != slice_us * 1000:
        return after, "unchanged: this kernel ignores a custom slice (6.12+ honours it)"
    return after, "set so the engine's threads preempt the API process on wake-up (FDPLUG_ENGINE_SLICE_US)"
