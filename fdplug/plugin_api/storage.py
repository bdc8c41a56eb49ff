"""The feature-storage contract: bytes by URL, many at once, in order.

A storage is picked per URL scheme at startup. ``fetch_many`` must yield results in the order the
URLs were given, whatever order they finish in, and stop at the first failure (in that order) by
raising it: a caller never receives a shorter list silently.

`display_url` is the only form of a URL a storage may put in a message or a log. A storage that
downloads in parallel keeps the ordering rule with `fdplug.core.portable.ordered_fetch.ordered_map`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import (
    Protocol,
    runtime_checkable,
)
from urllib.parse import urlsplit

from fdplug.errors import FeatureAccessDeniedError


def url_scheme(url: str) -> str:
    """The scheme of a feature URL, lower-cased; an URL without one (or not an URL at all) is refused."""
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError:
        scheme = ""
    if not scheme:
        raise FeatureAccessDeniedError(f"feature URL {display_url(url)!r} has no scheme or is malformed.",
                                       url=display_url(url),
                                       fix="use bos://bucket/key, file:///abs/path or https://host/path.")
    return scheme


@runtime_checkable
class FeatureStorage(Protocol):
    """What a feature storage's factory returns. Safe to call from several threads at once."""

    name: str

    def fetch(self, url: str, *, timeout: float | None = None) -> bytes:
        """The object's bytes. Raises a `fdplug.errors.StorageError` subclass naming the URL."""
        ...

    def fetch_many(self, urls: Sequence[str], *, timeout: float | None = None) -> Iterator[bytes]:
        """Each URL's bytes, yielded in the order given; raises at the first failure in that order."""
        ...

    def close(self) -> None:
        """Release connections and worker threads."""
        ...


def display_url(url: str) -> str:
    """``url`` without user-info, query or fragment (presigned URLs carry tokens there): safe to show."""
    try:
        parts = urlsplit(url)
    except ValueError:     # e.g. an unclosed IPv6 bracket: show nothing of it (it may hold a token)
        return "<a malformed URL>"
    host = parts.netloc.rsplit("@", 1)[-1]
    hidden = "?<query hidden>" if parts.query else ""
    return f"{parts.scheme}://{host}{parts.path}{hidden}"
