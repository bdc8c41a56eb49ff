"""Fetching features by URL: which storage serves a URL.

The engine, ``fdplug fetch-features`` and the benchmark share this module. Storages are chosen per
scheme by selection (`fdplug.core.plugin_loading.selection.select_storages`) and built lazily, the
first time a URL of their scheme is fetched, so credentials are read only when needed. Storages parallelise with
`fdplug.core.portable.ordered_fetch.ordered_map`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from itertools import groupby

from fdplug.core.config import EngineConfig
from fdplug.errors import FeatureAccessDeniedError
from fdplug.plugin_api.specs import FeatureStorageSpec
from fdplug.plugin_api.storage import FeatureStorage, display_url, url_scheme

# ---------------------------------------------------------------------------------------------------
# storages by scheme
# ---------------------------------------------------------------------------------------------------


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
