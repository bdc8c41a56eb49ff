"""``ordered_map``: many downloads at once, results in order, stop at the first failure.

The one implementation of `fdplug.plugin_api.storage`'s ordering rule for storages that parallelise
(BOS), so the ordering and cancellation rules live in one place.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from fdplug.errors import StorageError

T = TypeVar("T")
R = TypeVar("R")
_END = object()


def ordered_map(pool: Executor, fn: Callable[[T], R], items: Sequence[T], *, window: int,
                wait_timeout: float, on_timeout: Callable[[T], Exception]) -> Iterator[R]:
    """``fn(item)`` for every item on ``pool``, yielded in the order of ``items``.

    At most ``window`` calls are submitted and not yet yielded, so memory is bounded whatever the
    number of items. The first failure *in order* is raised once every earlier result is yielded.
    The moment any call fails, every later call not yet started is cancelled and nothing new is
    submitted (the sequence cannot get past it); when the generator ends (failure, or the caller
    stops early) the rest is cancelled and in-flight results are dropped. A call that succeeds,
    after retries or not, is always yielded: nothing is skipped silently. ``wait_timeout`` bounds
    the wait for the oldest call; ``on_timeout(item)`` builds its error.
    """
    calls = _Window(pool, fn, window)
    remaining = iter(items)
    try:
        while True:
            calls.fill(remaining)
            oldest = calls.pop()
            if oldest is None:
                return
            item, future = oldest
            try:
                result = future.result(timeout=wait_timeout)
            except FutureTimeout:
                raise on_timeout(item) from None
            except CancelledError:  # the pool was shut down under us (storage closed)
                raise _closed_error() from None
            yield result
    finally:
        calls.cancel_after(-1)


def _closed_error() -> StorageError:
    return StorageError("a feature fetch was cancelled because its storage was closed.",
                        fix="this happens at shutdown; retry on a running server.")


class _Window:
    """Submitted calls not yet yielded, oldest first. A failed call cancels every later one at once."""

    def __init__(self, pool: Executor, fn: Callable, size: int) -> None:
        self._pool, self._fn, self._size = pool, fn, size
        self._pending: deque[tuple[int, Any, Future]] = deque()
        self._lock = threading.Lock()
        self._submitted = 0
        self._failed = False

    def fill(self, remaining: Iterator) -> None:
        while True:
            with self._lock:
                if self._failed or len(self._pending) >= self._size:
                    return
            item = next(remaining, _END)
            if item is _END:
                return
            try:
                index, future = self._submitted, self._pool.submit(self._fn, item)
            except RuntimeError:  # "cannot schedule new futures after shutdown"
                raise _closed_error() from None
            self._submitted += 1
            with self._lock:
                self._pending.append((index, item, future))
            future.add_done_callback(lambda done, i=index: self._on_done(i, done))

    def pop(self) -> tuple[Any, Future] | None:
        with self._lock:
            if not self._pending:
                return None
            _, item, future = self._pending.popleft()
            return item, future

    def cancel_after(self, index: int) -> None:
        """Cancel the calls after ``index`` that have not started (running ones finish; results dropped)."""
        with self._lock:
            later = [future for i, _, future in self._pending if i > index]
        for future in later:  # outside the lock: cancel() runs done-callbacks, which take it
            future.cancel()

    def _on_done(self, index: int, future: Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            with self._lock:
                self._failed = True
            self.cancel_after(index)
