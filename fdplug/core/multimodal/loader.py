"""Fetching a request's features off the step loop, into the encoder cache; pictures are encoded there.

``submit`` pins what the encoder cache already holds and sends the rest to a thread pool (one task
per request; the storage parallelises the links of one request). ``poll`` is called by the step
loop: it never waits, and hands back the requests whose features are all in (ready to schedule)
or whose fetch failed (to fail alone, with the error that says why).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from fdplug.core.multimodal.encoder_cache import EncoderCache
from fdplug.core.multimodal.features import decode_feature, validate_feature
from fdplug.core.multimodal.fetch import FeatureFetcher
from fdplug.core.multimodal.inputs import MMFeatureInput, content_hash
from fdplug.core.multimodal.pictures import picture_hash
from fdplug.core.request import Request
from fdplug.errors import (
    FdplugError,
    FeatureFormatError,
    InvalidRequestError,
    StorageError,
)
from fdplug.plugin_api.storage import display_url

logger = logging.getLogger("fdplug.multimodal")


@dataclass(slots=True)
class Fetched:
    """One item's features and identity, decoded in the worker thread."""

    index: int
    mm_hash: str
    features: np.ndarray


class FeatureLoader:
    def __init__(self, fetcher: FeatureFetcher, cache: EncoderCache, hidden_size: int, *, workers: int,
                 timeout: float, encoder: Callable[[bytes, str], np.ndarray] | None = None,
                 thread_setup: Callable[[], None] | None = None) -> None:
        """``encoder``: a picture's bytes -> its features (the model's vision tower); None: the
        model takes features only (the API refuses pictures before they get here). ``thread_setup``
        runs once in each worker thread (the device's `DeviceSpec.setup`: thread counts and OpenMP
        settings are per thread, and the tower computes there)."""
        self.fetcher = fetcher
        self.encoder = encoder
        self.cache = cache
        self.hidden_size = hidden_size
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fdplug-features",
                                        initializer=thread_setup)
        self._pending: dict[str, tuple[Request, Future]] = {}
        self._lock = threading.Lock()

    # -- engine thread ----------------------------------------------------------------------------

    def check_cached(self, request: Request) -> None:
        """Items the cache already holds (a uuid seen before) must have the rows their grid asks for,
        exactly as a fresh download is checked: a 400 naming both numbers, before anything is pinned."""
        for index, item in enumerate(request.mm_inputs):
            if item.mm_hash is not None and item.mm_hash in self.cache:
                _check_rows(index, item, len(self.cache.get(item.mm_hash)))

    def submit(self, request: Request) -> bool:
        """Start fetching what the cache lacks; True if everything was already cached."""
        missing = []
        for i, (item, _pos) in enumerate(zip(request.mm_inputs, request.mm_positions)):
            if item.mm_hash is None or not self.cache.acquire(item.mm_hash, request.request_id):
                missing.append(i)
        if not missing:
            return True
        future = self._pool.submit(self._fetch, request, missing)
        self._pending[request.request_id] = (request, future)
        return False

    def poll(self) -> list[tuple[Request, FdplugError | None]]:
        """Requests whose fetch finished since the last poll: (request, None) or (request, error)."""
        done = [rid for rid, (_, future) in self._pending.items() if future.done()]
        results = []
        for rid in done:
            request, future = self._pending.pop(rid)
            try:
                fetched = future.result(timeout=0)
            except FdplugError as exc:
                results.append((request, exc))
                continue
            except Exception as exc:  # a bug in a storage plugin: fail the request, not the engine
                logger.exception("feature fetch for request %s failed", rid)
                results.append((request, StorageError(f"fetching features failed: {type(exc).__name__}: {exc}")))
                continue
            try:
                for item in fetched:
                    self.cache.put(item.mm_hash, item.features, rid)
                    request.mm_positions[item.index] = replace(request.mm_positions[item.index], mm_hash=item.mm_hash)
                    # another request may have cached this uuid, with other rows, while this one downloaded
                    _check_rows(item.index, request.mm_inputs[item.index], len(self.cache.get(item.mm_hash)))
            except FdplugError as exc:
                results.append((request, exc))
                continue
            results.append((request, None))
        return results

    def holds(self, request: Request) -> bool:
        """Whether the request holds (pins) every item's features in the encoder cache."""
        return all(self.cache.held_by(p.mm_hash, request.request_id) for p in request.mm_positions)

    def hashes(self, request: Request) -> list[str]:
        return [p.mm_hash for p in request.mm_positions if p.mm_hash]

    def cancel(self, request_id: str) -> None:
        entry = self._pending.pop(request_id, None)
        if entry is not None:
            entry[1].cancel()  # a running fetch finishes on its own; its result is dropped

    def has_pending(self) -> bool:
        return bool(self._pending)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.fetcher.close()

    # -- worker thread ----------------------------------------------------------------------------

    def _fetch(self, request: Request, indices: list[int]) -> list[Fetched]:
        """All links of the request's missing items in one ordered, parallel fetch; rows joined per item;
        pictures encoded."""
        items = [request.mm_inputs[i] for i in indices]
        blobs = iter(self.fetcher.fetch_many([u for item in items for u in item.urls], timeout=self.timeout))
        out = []
        for i, item in zip(indices, items):
            if item.data:
                out.append(self._encode(i, item))
                continue
            parts = [next(blobs) for _ in item.urls]
            arrays, rows = [], 0
            for data, url in zip(parts, item.urls):   # checked piece by piece, before joining them
                array = decode_feature(data, display_url(url))
                validate_feature(array, display_url(url), None, self.hidden_size)
                rows += len(array)
                if rows > item.num_tokens:
                    raise FeatureFormatError(f"feature {display_url(item.urls[0])} has at least {rows} rows, more than "
                                             f"the {item.num_tokens} its grid_thw {list(item.grid_thw)} makes.",
                                             url=display_url(url), fix="send the grid the features were encoded with.")
                arrays.append(array)
            features = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
            validate_feature(features, display_url(item.urls[0]) + (f" (+{len(item.urls) - 1} more)" if
                             len(item.urls) > 1 else ""), item.num_tokens, self.hidden_size)
            out.append(Fetched(i, item.mm_hash or content_hash(parts), np.ascontiguousarray(features, np.float32)))
        return out


    def _encode(self, index: int, item: MMFeatureInput) -> Fetched:
        name = f"image item {index}"
        if self.encoder is None:
            raise InvalidRequestError(f"{name} is a picture, but this model's vision tower does not run here.",
                                      fix="send pre-encoded features (image_feature).", param="messages")
        features = self.encoder(item.data, name)
        validate_feature(features, name, item.num_tokens, self.hidden_size)
        return Fetched(index, item.mm_hash or picture_hash(item.data), features)


def _check_rows(index: int, item: MMFeatureInput, rows: int) -> None:
    if rows != item.num_tokens:
        raise InvalidRequestError(
            f"{item.modality} item {index} reuses cached features (the same uuid) with {rows} rows, but its "
            f"grid_thw {list(item.grid_thw)} makes {item.num_tokens} placeholder tokens.",
            fix="send the grid the features were encoded with, or a new uuid for different features.",
            param="messages")
