"""Fetching features by URL: which storage serves a URL, and ordered parallel fetching.

The engine, ``fdplug fetch-features`` and the benchmark share this module. Storages are chosen per
scheme with the same rule as ``select_backend`` (highest priority, then name) and built lazily, the
first time a URL of their scheme is fetched, so credentials are read only when needed.

`ordered_map` is the one implementation of "many downloads at once, results in order, stop at the
first failure": storages that parallelise (BOS) use it, so the ordering and cancellation rules
live in one place.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import CancelledError, Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout
from itertools import groupby
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence, TypeVar
from urllib.parse import urlsplit

from fdplug.core.config import EngineConfig
from fdplug.core.specs import FeatureStorageSpec
from fdplug.core.storage import FeatureStorage, url_scheme
from fdplug.errors import FeatureAccessDeniedError, StorageError

if TYPE_CHECKING:
    from fdplug.core.plugins import PluginSet

T = TypeVar("T")
R = TypeVar("R")
_END = object()


def display_url(url: str) -> str:
    """``url`` without user-info, query or fragment (presigned URLs carry tokens there): safe to show."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    hidden = "?<query hidden>" if parts.query else ""
    return f"{parts.scheme}://{host}{parts.path}{hidden}"


# ---------------------------------------------------------------------------------------------------
# ordered parallel map
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# storages by scheme
# ---------------------------------------------------------------------------------------------------


def storage_specs(plugins: PluginSet | None = None) -> dict[str, FeatureStorageSpec]:
    """The storage serving each scheme: highest priority first, then name (``select_backend``'s rule)."""
    if plugins is None:
        from fdplug.core.plugins import current_plugins

        plugins = current_plugins()
    chosen: dict[str, FeatureStorageSpec] = {}
    for entry in sorted(plugins.registry.entries("storage"), key=lambda e: (-e.spec.priority, e.spec.name)):
        for scheme in entry.spec.schemes:
            chosen.setdefault(scheme, entry.spec)
    return chosen


def storage_for_urls(urls: Sequence[str], specs: Mapping[str, FeatureStorageSpec]) -> dict[str, FeatureStorageSpec]:
    """The spec for each scheme used by ``urls``; an unsupported scheme is refused before any fetch."""
    needed: dict[str, FeatureStorageSpec] = {}
    for url in urls:
        scheme = url_scheme(url)
        if scheme not in specs:
            known = ", ".join(f"{s}://" for s in sorted(specs)) or "none"
            raise FeatureAccessDeniedError(
                f"no feature storage handles {scheme}:// (URL {display_url(url)}); handled: {known}.",
                url=display_url(url), fix="use a supported scheme, or install/enable the plugin for this one "
                             "(`fdplug plugins` lists what is loaded).")
        needed[scheme] = specs[scheme]
    return needed


class FeatureFetcher:
    """Builds each selected storage once, on first use, and routes URLs to it. Thread-safe."""

    def __init__(self, specs: Mapping[str, FeatureStorageSpec], config: EngineConfig | None = None) -> None:
        self._specs = dict(specs)
        self._config = config if config is not None else EngineConfig()
        self._storages: dict[str, FeatureStorage] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_plugins(cls, config: EngineConfig | None = None, plugins: PluginSet | None = None) -> "FeatureFetcher":
        return cls(storage_specs(plugins), config)

    def storage(self, url: str) -> FeatureStorage:
        """The storage for ``url``'s scheme, built by its factory the first time it is needed."""
        spec = storage_for_urls([url], self._specs)[url_scheme(url)]
        with self._lock:
            if spec.name not in self._storages:
                self._storages[spec.name] = spec.factory(self._config)
            return self._storages[spec.name]

    def fetch_many(self, urls: Sequence[str], *, timeout: float | None = None) -> Iterator[bytes]:
        """Bytes of every URL in order; consecutive URLs of one storage go to its ``fetch_many`` together."""
        storage_for_urls(urls, self._specs)  # refuse unsupported schemes before fetching anything
        for storage, run in groupby(urls, key=self.storage):
            yield from storage.fetch_many(list(run), timeout=timeout)

    def close(self) -> None:
        with self._lock:
            storages, self._storages = list(self._storages.values()), {}
        for storage in storages:
            storage.close()
