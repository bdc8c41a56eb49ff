"""Baidu Object Storage features: ordered parallel download with bounded, countable retries.

Why not the SDK's own retry: it cannot tell throttling from a missing object, its attempts are
invisible to us, and it has no total deadline. So the client gets ``NoRetryPolicy`` and every retry
happens here: exponential backoff with jitter, at most ``max_retries`` per object and never past
``retry_deadline``; 403/404 fail at once. (The SDK still re-signs once by itself on a 403, for clock
skew; that is its only hidden attempt.)

Parallel downloads go through `fdplug.core.portable.ordered_fetch.ordered_map`: results in submission
order, a bounded window of futures, and once a download fails nothing after it starts.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from fdplug.core.portable.ordered_fetch import ordered_map
from fdplug.errors import StorageError, StorageTimeoutError
from fdplug.plugins.storage_bos.failures import (
    classify,
    install_log_redaction,
    to_error,
)
from fdplug.plugins.storage_bos.settings import BosObject, BosSettings, parse_bos_url

if TYPE_CHECKING:
    from fdplug.plugin_api.engine_config import EngineView

logger = logging.getLogger("fdplug.storage.bos")

WINDOW_PER_WORKER = 2  # futures in flight per worker: keeps workers busy while the caller consumes


class BosStorage:
    """``bos://bucket/key`` features. Safe to share between threads; ``close()`` stops its workers."""

    name = "bos"

    def __init__(self, settings: BosSettings | None = None, *, config: EngineView | None = None) -> None:
        self._settings = settings
        self._config = config
        self._lock = threading.RLock()
        self._client: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._closed = threading.Event()  # also wakes up backoff sleeps at close()

    def __repr__(self) -> str:
        endpoint = self._settings.endpoint if self._settings is not None else "<from env, not read yet>"
        return f"BosStorage(endpoint={endpoint!r})"

    @property
    def settings(self) -> BosSettings:
        """Read from the environment on first use, so a server without bos:// URLs needs no BOS settings."""
        with self._lock:
            if self._settings is None:
                self._settings = BosSettings.from_env(self._config)
            return self._settings

    # ----------------------------------------------------------------------------------------------
    # the FeatureStorage API
    # ----------------------------------------------------------------------------------------------

    def fetch(self, url: str, *, timeout: float | None = None) -> bytes:
        """One object's bytes, with retries; raises a `StorageError` subclass naming ``url``."""
        return self._download(parse_bos_url(url), timeout or self.settings.timeout)

    def fetch_many(self, urls: Sequence[str], *, timeout: float | None = None) -> Iterator[bytes]:
        """Every object's bytes in the order given; raises at the first failure in that order.

        Every URL is parsed before the first download starts, so a malformed one costs nothing.
        One URL, or ``FD_BOS_DOWNLOAD_PARALLEL=1``, takes the sequential path.
        """
        objects = [parse_bos_url(url) for url in urls]
        timeout = timeout or self.settings.timeout
        if len(objects) <= 1 or self.settings.parallel == 1:
            return (self._download(obj, timeout) for obj in objects)
        return ordered_map(self._executor(), lambda obj: self._download(obj, timeout), objects,
                           window=self.settings.parallel * WINDOW_PER_WORKER,
                           wait_timeout=self._link_budget(timeout),
                           on_timeout=lambda obj: StorageTimeoutError(
                               f"fetching {obj.url} took longer than {self._link_budget(timeout):.0f}s.",
                               url=obj.url, fix="raise FDPLUG_FETCH_TIMEOUT, or check the BOS endpoint."))

    def close(self) -> None:
        """Stop backoff sleeps, cancel queued downloads and wait for running ones (each bounded by its timeout)."""
        self._closed.set()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    # ----------------------------------------------------------------------------------------------
    # one object, with retries
    # ----------------------------------------------------------------------------------------------

    def _download(self, obj: BosObject, timeout: float) -> bytes:
        settings = self.settings
        started = time.monotonic()
        deadline = started + settings.retry_deadline
        attempt = 0
        while True:
            attempt += 1
            self._check_open(obj)
            try:
                return self._get(obj, timeout)
            except Exception as exc:  # noqa: BLE001 - every SDK/socket error is classified below
                failure = classify(exc, settings.secrets())
            delay = self._backoff(settings, attempt)
            if not failure.retryable or attempt > settings.max_retries or time.monotonic() + delay > deadline:
                raise to_error(failure, obj.url, attempt, time.monotonic() - started) from None
            logger.warning("BOS fetch of %s failed (%s), retry %d/%d in %.2fs", obj.url, failure.detail, attempt,
                           settings.max_retries, delay)
            if self._closed.wait(delay):
                self._check_open(obj)

    def _get(self, obj: BosObject, timeout: float) -> bytes:
        data = self._bos().get_object_as_string(obj.bucket, obj.key, config=self._request_config(timeout))
        return bytes(data)

    @staticmethod
    def _backoff(settings: BosSettings, attempt: int) -> float:
        """Exponential backoff with equal jitter: half fixed, half random, so retries of a burst spread out."""
        ceiling = min(settings.retry_cap, settings.retry_base * 2 ** (attempt - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def _link_budget(self, timeout: float) -> float:
        """The longest one object can take: its retries stop by the deadline, each attempt by the timeout."""
        return self.settings.retry_deadline + timeout + 1.0

    def _check_open(self, obj: BosObject) -> None:
        if self._closed.is_set():
            raise StorageError(f"the BOS storage was closed while fetching {obj.url}.", url=obj.url,
                               fix="this happens at shutdown; retry the request on a running server.")

    # ----------------------------------------------------------------------------------------------
    # lazily built, shared client and pool
    # ----------------------------------------------------------------------------------------------

    def _bos(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = _make_client(self.settings)
            return self._client

    def _request_config(self, timeout: float) -> Any:
        """Per-call config carrying the timeout. The SDK merges every non-None field into the client's,
        so it repeats ours (no retries, path style) rather than letting SDK defaults override them."""
        return _client_config(self.settings, timeout, credentials=None)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed.is_set():
                raise StorageError("the BOS storage is closed.", fix="create a new storage (restart the engine).")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.settings.parallel, thread_name_prefix="fdplug-bos")
            return self._pool


def _client_config(settings: BosSettings, timeout: float, credentials: Any) -> Any:
    from baidubce.bce_client_configuration import BceClientConfiguration
    from baidubce.retry.retry_policy import NoRetryPolicy

    return BceClientConfiguration(credentials=credentials, endpoint=settings.endpoint,
                                  security_token=settings.sts_token, retry_policy=NoRetryPolicy(),
                                  connection_timeout_in_mills=int(timeout * 1000), path_style_enable=True)


def _make_client(settings: BosSettings) -> Any:
    """Import the SDK (only now), hide our secrets from its loggers, and build one client."""
    from baidubce.auth.bce_credentials import BceCredentials
    from baidubce.services.bos.bos_client import BosClient

    install_log_redaction(settings.secrets())
    credentials = BceCredentials(settings.access_key, settings.secret_key)
    return BosClient(_client_config(settings, settings.timeout, credentials))
