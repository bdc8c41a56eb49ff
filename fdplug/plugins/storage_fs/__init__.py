"""Built-in ``storage_fs`` plugin: ``file://`` features under allowed roots, ``http(s)://`` from allowed hosts.

Two storages, because their risks and settings differ: ``file`` reads only under
``EngineConfig.allowed_feature_paths`` (FDPLUG_ALLOWED_FEATURE_PATHS), ``http`` only from
FDPLUG_ALLOWED_FEATURE_HOSTS, at most FDPLUG_HTTP_FEATURE_MAX_BYTES per feature. Both refuse
everything until the operator allows something. httpx is imported on the first http(s) fetch.
"""

from __future__ import annotations

from fdplug.plugin_api.hookspecs import API_VERSION, hookimpl
from fdplug.plugin_api.settings import Setting, parse_list, parse_positive_int
from fdplug.plugin_api.specs import FeatureStorageSpec

FDPLUG_API_VERSION = API_VERSION

HTTP_MAX_BYTES = Setting("FDPLUG_HTTP_FEATURE_MAX_BYTES", 256 * 1024 * 1024, parse_positive_int,
                         "Largest http(s):// feature accepted, in bytes (enforced while streaming).")
ALLOWED_HOSTS = Setting("FDPLUG_ALLOWED_FEATURE_HOSTS", (), parse_list,
                        "Comma-separated hosts (host, host:port or *.domain) http(s):// features may come from "
                        "(default: none).")


def make_file_storage(config):
    from fdplug.plugins.storage_fs.file_storage import FileStorage

    return FileStorage(config.allowed_feature_paths)


def make_http_storage(config):
    from fdplug.plugins.storage_fs.http_storage import HttpStorage

    return HttpStorage(ALLOWED_HOSTS.value(), HTTP_MAX_BYTES.value(), config.fetch_timeout)


@hookimpl
def fdplug_register_feature_storages(register):
    register(FeatureStorageSpec(name="file", schemes=("file",), factory=make_file_storage, priority=0,
                                description="local files under FDPLUG_ALLOWED_FEATURE_PATHS"))
    register(FeatureStorageSpec(name="http", schemes=("http", "https"), factory=make_http_storage, priority=0,
                                description="http(s) from FDPLUG_ALLOWED_FEATURE_HOSTS, size-limited, via httpx"))


@hookimpl
def fdplug_register_settings(register):
    register(HTTP_MAX_BYTES)
    register(ALLOWED_HOSTS)
