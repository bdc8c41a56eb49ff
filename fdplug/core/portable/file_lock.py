"""An exclusive lock on a file, waited for up to a deadline.

Processes that start together on one machine (an API process and its engines, DP ranks, a PD pair)
share files under the cache dir: the op timings (`worker.op_timing`), a named model's download
(`fdplug.demo.pypi_models`), the cpu kernels' build (`fdplug.plugins.cpu.kernel_build`). One of
them does the work under the lock; the others wait, then find it done. Every wait has a deadline,
and a file system without locks (some network mounts) lets the work go on unlocked rather than fail.
"""

from __future__ import annotations

import time
from typing import IO, Any

POLL_S = 0.05


def lock_within(lock: IO[Any], timeout: float) -> bool | None:
    """Take an exclusive ``flock`` on the open file ``lock`` within ``timeout`` seconds: True when
    taken, False when another process still held it at the deadline, None when the file system
    has no locks (go on without). Released when the file is closed."""
    import fcntl

    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        except OSError:
            return None
