"""``http(s)://`` features from hosts the operator allowed, with a timeout and a size limit.

A feature URL comes from a client, so fetching any URL would let clients make the server request
internal addresses (SSRF) or download without bound. Hence: a host allow-list (empty = http(s)
features disabled), no redirects (a redirect could leave the allowed hosts), a size limit checked
against Content-Length and again while streaming (decoded bytes, so compression cannot dodge it),
and a total deadline checked per chunk on top of httpx's per-operation timeouts. URLs are shown
without user-info or query string, which may hold tokens (presigned URLs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

from fdplug.errors import (
    ConfigError,
    FeatureAccessDeniedError,
    FeatureNotFoundError,
    StorageError,
    StorageTimeoutError,
)
from fdplug.plugin_api.storage import display_url

_HOSTS_FIX = "allow the host with FDPLUG_ALLOWED_FEATURE_HOSTS=features.example.com (comma-separated; " \
             "host, host:port or *.domain)."


class HttpStorage:
    """Fetches features over HTTP(S) with one shared httpx client (built on first use, thread-safe)."""

    name = "http"

    def __init__(self, hosts: Sequence[str], max_bytes: int, timeout: float) -> None:
        self.hosts = tuple(h.strip().lower() for h in hosts if h.strip())
        self.max_bytes = max_bytes
        self.timeout = timeout
        self._client: Any = None
        self._lock = threading.Lock()

    def fetch(self, url: str, *, timeout: float | None = None) -> bytes:
        self.check(url)
        return self._download(url, timeout or self.timeout)

    def fetch_many(self, urls: Sequence[str], *, timeout: float | None = None) -> Iterator[bytes]:
        """Sequential, in order; every URL is checked against the allow-list before the first request."""
        for url in urls:
            self.check(url)
        return (self._download(url, timeout or self.timeout) for url in urls)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def check(self, url: str) -> None:
        """Refuse a URL whose scheme is not http(s) or whose host is not allowed."""
        shown = display_url(url)
        if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):     # never sent: a client's malformed URL
            raise FeatureAccessDeniedError(f"feature URL {shown!r} holds a space or a control character.", url=shown,
                                           fix="percent-encode it (e.g. %20 for a space).")
        try:
            parts = urlsplit(url)
            parts.port      # noqa: B018 - parsed lazily: an out-of-range or non-numeric port raises here
        except ValueError:
            raise FeatureAccessDeniedError(f"feature URL {shown!r} is malformed.", url=shown,
                                           fix="send https://host[:port]/path.") from None
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise FeatureAccessDeniedError(f"{shown!r} is not an http(s) URL with a host.", url=shown,
                                           fix="use https://host/path.")
        if not self.hosts:
            raise FeatureAccessDeniedError(f"http(s) features are disabled: no host is allowed (URL {shown}).",
                                           url=shown, fix=_HOSTS_FIX)
        if not _host_allowed(parts.hostname.lower(), parts.port, self.hosts):
            raise FeatureAccessDeniedError(f"host {parts.hostname!r} of feature URL {shown} is not allowed.",
                                           url=shown, fix=_HOSTS_FIX)

    # ----------------------------------------------------------------------------------------------

    def _download(self, url: str, timeout: float) -> bytes:
        import httpx

        shown = display_url(url)
        deadline = time.monotonic() + timeout
        try:
            with self._http().stream("GET", url, timeout=httpx.Timeout(timeout)) as response:
                _check_status(response.status_code, shown)
                _check_size(response.headers.get("content-length"), self.max_bytes, shown)
                return self._read(response, deadline, timeout, shown)
        except httpx.TimeoutException:
            raise _timeout(shown, timeout) from None
        except httpx.HTTPError as exc:
            raise StorageError(f"fetching {shown} failed: {type(exc).__name__}.", url=shown,
                               fix="check that the host is reachable from the server.") from None

    def _read(self, response: Any, deadline: float, timeout: float, shown: str) -> bytes:
        body = bytearray()
        for chunk in response.iter_bytes():
            body += chunk
            if len(body) > self.max_bytes:
                raise _too_big(shown, self.max_bytes)
            if time.monotonic() > deadline:
                raise _timeout(shown, timeout)
        return bytes(body)

    def _http(self) -> Any:
        with self._lock:
            if self._client is None:
                try:
                    import httpx
                except ImportError:
                    raise ConfigError("http(s):// features need the httpx package, which is not installed.",
                                      fix="pip install httpx") from None
                self._client = httpx.Client(follow_redirects=False)
            return self._client


def _host_allowed(host: str, port: int | None, allowed: tuple[str, ...]) -> bool:
    for entry in allowed:
        if entry == "*" or entry == host or (port is not None and entry == f"{host}:{port}"):
            return True
        if entry.startswith("*.") and host.endswith(entry[1:]):
            return True
    return False


def _check_status(status: int, shown: str) -> None:
    if 200 <= status < 300:
        return
    if status in (404, 410):
        raise FeatureNotFoundError(f"feature {shown} does not exist (HTTP {status}).", url=shown,
                                   fix="check the URL; the object may have expired.")
    if status in (401, 403):
        raise FeatureAccessDeniedError(f"the server of {shown} refused access (HTTP {status}).", url=shown,
                                       fix="use a URL the server can read without credentials (e.g. a presigned URL).")
    if 300 <= status < 400:
        raise FeatureAccessDeniedError(f"feature {shown} redirects (HTTP {status}); redirects are not followed.",
                                       url=shown, fix="give the final URL, on an allowed host.")
    raise StorageError(f"fetching {shown} failed with HTTP {status}.", url=shown,
                       fix="check the feature server; retry later if it is overloaded.")


def _check_size(content_length: str | None, max_bytes: int, shown: str) -> None:
    if content_length is not None and content_length.isdigit() and int(content_length) > max_bytes:
        raise _too_big(shown, max_bytes, int(content_length))


def _too_big(shown: str, max_bytes: int, size: int | None = None) -> StorageError:
    told = f"{size} bytes" if size is not None else f"more than {max_bytes} bytes"
    return FeatureAccessDeniedError(f"feature {shown} is {told}; the limit is {max_bytes} bytes.", url=shown,
                                    fix="raise FDPLUG_HTTP_FEATURE_MAX_BYTES if such features are expected.")


def _timeout(shown: str, timeout: float) -> StorageTimeoutError:
    return StorageTimeoutError(f"fetching {shown} took longer than {timeout:g}s.", url=shown,
                               fix="raise FDPLUG_FETCH_TIMEOUT (or the request timeout), or check the feature server.")
