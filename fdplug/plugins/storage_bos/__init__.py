"""Built-in ``storage_bos`` plugin: ``bos://bucket/key`` features from Baidu Object Storage.

Light on purpose: registering imports nothing from ``bce-python-sdk``. The factory reads the BOS
settings (FDPLUG_BOS_* or FastDeploy's ENCODE_FEATURE_* variables) when the first bos:// URL is
fetched, and the SDK is imported when the first request is made.
"""

from __future__ import annotations

from fdplug.plugin_api.hookspecs import API_VERSION, hookimpl
from fdplug.plugin_api.specs import FeatureStorageSpec

FDPLUG_API_VERSION = API_VERSION


def make_storage(config):
    """``FeatureStorageSpec.factory``: a `BosStorage` that reads its settings from the environment on first use.

    Building it never fails for missing credentials (``fdplug doctor`` and the conformance kit build
    every storage); the first bos:// fetch does, with a ConfigError naming the variables to set.
    """
    from fdplug.plugins.storage_bos.storage import BosStorage

    return BosStorage(config=config)


@hookimpl
def fdplug_register_feature_storages(register):
    register(FeatureStorageSpec(name="bos", schemes=("bos",), factory=make_storage, priority=0,
                                description="Baidu Object Storage via bce-python-sdk: parallel, ordered, retried"))


@hookimpl
def fdplug_register_settings(register):
    from fdplug.plugins.storage_bos.settings import SETTINGS

    for setting in SETTINGS:
        register(setting)
