"""Storage contract: every registered storage builds; file:// round-trips in order."""

from __future__ import annotations

import numpy as np
import pytest

from fdplug.core.config import EngineConfig
from fdplug.errors import StorageError
from fdplug.plugin_api.storage import FeatureStorage


def test_every_storage_builds_to_the_protocol(fdplug_plugin_set, tmp_path):
    config = EngineConfig(allowed_feature_paths=(str(tmp_path),))
    for entry in fdplug_plugin_set.registry.entries("storage"):
        storage = entry.spec.factory(config)
        try:
            assert isinstance(storage, FeatureStorage), f"{entry.spec.name} does not implement FeatureStorage"
        finally:
            storage.close()


def test_file_storage_round_trip_in_order(fdplug_selection, tmp_path):
    spec = fdplug_selection.storages.get("file")
    if spec is None:
        pytest.skip("no storage handles file:// here")
    urls, blobs = [], []
    for i in range(6):
        path = tmp_path / f"f{i}.npy"
        np.save(path, np.full((i + 1, 4), i, dtype=np.float32))
        urls.append(path.as_uri())
        blobs.append(path.read_bytes())
    storage = spec.factory(EngineConfig(allowed_feature_paths=(str(tmp_path),)))
    try:
        assert storage.fetch(urls[2]) == blobs[2]
        assert list(storage.fetch_many(urls, timeout=10)) == blobs
        assert list(storage.fetch_many(urls[::-1], timeout=10)) == blobs[::-1]
        with pytest.raises(StorageError) as err:
            list(storage.fetch_many([urls[0], (tmp_path / "missing.npy").as_uri()], timeout=10))
        assert "missing.npy" in str(err.value)
    finally:
        storage.close()
