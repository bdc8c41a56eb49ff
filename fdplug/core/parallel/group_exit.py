"""How a process of a paddle.distributed group ends: all together, then at once.

paddle's TCP store (the group's rendezvous, which `LockstepGroup.barrier` also uses) is hosted by
rank 0 on a daemon thread that serves every rank's connection. A normal interpreter exit runs the
C++ exit handlers while that thread still runs, and a connection closing meanwhile (the other
ranks leaving, or rank 0's own) can abort the process: SIGABRT or SIGSEGV after the rank's work
was done and written (seen on 2026-12-01 in 4 of 144 runs of the two-rank engine tests, six at once
on two cores, and once in CI: the main thread in ``mkl_serv_finalize`` under ``exit``, the daemon
thread in ``LibUVClient::readCallback`` calling ``abort``; none in 144 since). So a rank leaves in two steps:

- ``leave_group``: every rank waits until all are past their last collective (``done``), then
  rank 0 waits until the others have made their last call to its store (``gone``), so no rank's
  store client is left talking to a host that has exited;
- ``exit_process``: logs and standard streams flushed, then ``os._exit``: no exit handler runs
  beside the store's thread.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, NoReturn

logger = logging.getLogger("fdplug.engine")

LEAVE_TIMEOUT_S = 10.0   # the ranks leave their loops in the same round: within a step of each other


def arrivals_within(store: Any, key: str, count: int, timeout: float) -> int:
    """Poll the store's counter ``key`` until it reaches ``count`` or ``timeout`` seconds pass; the
    last value seen (below ``count``: somebody did not come)."""
    deadline = time.monotonic() + timeout
    while (arrived := store.add(key, 0)) < count and time.monotonic() <= deadline:
        time.sleep(0.05)
    return arrived


def leave_group(rank: int, size: int, timeout: float = LEAVE_TIMEOUT_S) -> bool:
    """Rank ``rank``'s last word to its group of ``size``, before `exit_process`; False (logged)
    when a rank did not come within ``timeout`` (a peer that died or never started)."""
    from paddle.base import core

    store = core.create_or_get_global_tcp_store()
    try:
        store.add("fdplug/done", 1)
        done = arrivals_within(store, "fdplug/done", size, timeout)
        if done < size:
            logger.warning("rank %d of %d leaves with only %d of the group done within %.0f s", rank, size, done,
                           timeout)
            return False
        if rank != 0:
            store.add("fdplug/gone", 1)     # this rank's last call to the store
            return True
        gone = arrivals_within(store, "fdplug/gone", size - 1, timeout)
        return gone == size - 1
    except Exception as exc:  # noqa: BLE001 -- the store's host already gone: nothing left to wait for
        logger.warning("rank %d of %d leaves without the group's store (%s: %s)", rank, size, type(exc).__name__,
                       str(exc)[:200])
        return False


def exit_process(code: int) -> NoReturn:
    """End this process with status ``code`` now: logs and standard streams flushed, no exit handlers."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # closed, or its reader gone: nothing to keep
            pass
    os._exit(code)
