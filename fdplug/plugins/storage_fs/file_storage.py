"""``file://`` features, readable only under directories the operator allowed.

A feature URL comes from a client, so a path is trusted only after it is fully resolved
(``os.path.realpath``: ``..`` and every symlink followed) and found inside an allowed root that is
resolved the same way. The resolved path is what gets opened, with ``O_NOFOLLOW``, so a symlink
planted after the check is refused rather than followed, and non-blocking, so a FIFO cannot hang
the fetch (anything but a regular file is refused). No roots configured: nothing is readable.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from urllib.parse import unquote, urlsplit

from fdplug.errors import FeatureAccessDeniedError, FeatureNotFoundError, StorageError

_ROOTS_FIX = ("allow the directory with FDPLUG_ALLOWED_FEATURE_PATHS=/data/features (several: separate them "
              f"with {os.pathsep!r}) or EngineConfig(allowed_feature_paths=(...)).")


class FileStorage:
    """Reads ``file:///abs/path`` under ``roots``. Stateless apart from the roots: safe across threads."""

    name = "file"

    def __init__(self, roots: Sequence[str]) -> None:
        self.roots = tuple(os.path.realpath(os.path.expanduser(root)) for root in roots if root)

    def fetch(self, url: str, *, timeout: float | None = None) -> bytes:
        """The file's bytes; a local read needs no timeout, so ``timeout`` is accepted and unused."""
        path = self.resolve(url)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise FeatureNotFoundError(f"feature file {url} does not exist.", url=url,
                                       fix="check the path; it must exist on the server's file system.") from None
        except PermissionError:
            raise FeatureAccessDeniedError(f"the server may not read {url} (permission denied).", url=url,
                                           fix="make the file readable by the user running fdplug.") from None
        except OSError as exc:  # ELOOP from O_NOFOLLOW: a symlink appeared after the check
            raise FeatureAccessDeniedError(f"feature file {url} could not be opened safely ({exc.strerror}).",
                                           url=url, fix="use a regular file under an allowed root.") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FeatureNotFoundError(f"feature URL {url} names a directory or device, not a file.", url=url,
                                       fix="point it at a .npy or .safetensors file.")
        with os.fdopen(fd, "rb") as handle:
            try:
                return handle.read()
            except OSError as exc:
                raise StorageError(f"reading {url} failed: {exc.strerror}.", url=url,
                                   fix="check the file and the disk.") from None

    def fetch_many(self, urls: Sequence[str], *, timeout: float | None = None) -> Iterator[bytes]:
        """Local reads are fast and disk-bound: sequential, in order. Every URL is checked first."""
        for url in urls:
            self.resolve(url)
        return (self.fetch(url, timeout=timeout) for url in urls)

    def close(self) -> None:
        """Nothing to release."""

    def resolve(self, url: str) -> str:
        """The real path ``url`` names, if it lies under an allowed root; else FeatureAccessDeniedError."""
        parts = urlsplit(url)
        if parts.scheme.lower() != "file":
            raise FeatureAccessDeniedError(f"{url!r} is not a file:// URL.", url=url, fix="use file:///abs/path.")
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise FeatureAccessDeniedError(f"file URL {url!r} must be file:///absolute/path (no host, query or "
                                           "fragment).", url=url, fix="use file:///abs/path.")
        if not self.roots:
            raise FeatureAccessDeniedError(f"file:// features are disabled: no directory is allowed (URL {url}).",
                                           url=url, fix=_ROOTS_FIX)
        raw = unquote(parts.path)
        if "\x00" in raw or not os.path.isabs(raw):
            raise FeatureAccessDeniedError(f"file URL {url!r} has no absolute path.", url=url,
                                           fix="use file:///abs/path.")
        real = os.path.realpath(raw)
        if not any(_inside(real, root) for root in self.roots):
            raise FeatureAccessDeniedError(
                f"feature file {url} resolves outside the directories allowed for features.",
                url=url, fix="move the file under an allowed directory, or " + _ROOTS_FIX)
        return real


def _inside(path: str, root: str) -> bool:
    return path == root or os.path.commonpath([path, root]) == root
