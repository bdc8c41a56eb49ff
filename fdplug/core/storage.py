"""The feature-storage contract: bytes by URL, many at once, in order.

A storage is picked per URL scheme at startup. ``fetch_many`` must yield results in the order the
URLs were given, whatever order they finish in, and stop at the first failure (in that order) by
raising it: a caller never receives a shorter list silently.
"""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence, runtime_checkable
from urllib.parse import urlsplit

from fdplug.errors import FeatureAccessDeniedError


def url_scheme(url: str) -> str:
    """The scheme of a feature URL, lower-cased; an URL without one is refused."""
    scheme = urlsplit(url).scheme.lower()
    if not scheme:
        raise FeatureAccessDeniedError(f"feature URL {url!r} has no scheme.", url=url,
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
