"""Plugin loading: built-ins, entry points, allow/deny lists, version checks, fault isolation.

The core's own portable components (runner, reference attention and MoE, op kernels) are
registered first, as the plugin ``core``, which cannot be disabled. Built-in plugins are modules
under ``fdplug.plugins``; third-party plugins are found through the ``fdplug`` entry-point group (the entry point's name
is the plugin's name, its value a light module).
Each plugin is imported, version-checked, registered and asked for its registrations on its own:
a plugin that fails at any step is recorded with its error and skipped, unless
``FDPLUG_STRICT_PLUGINS=1`` (or ``strict=True``) makes that fatal.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from fdplug.core.plugin_loading.registry import Registry
from fdplug.core.settings import env
from fdplug.errors import FdplugError, PluginError, PluginVersionError
from fdplug.plugin_api import hookspecs

logger = logging.getLogger("fdplug.plugins")

ENTRY_POINT_GROUP = "fdplug"

CORE_PLUGIN = ("core", "fdplug.core.plugin_loading.core_plugin")
"""The core's portable components, registered like a plugin's so selection treats them alike."""

BUILTIN_PLUGINS: dict[str, str] = {
    "cpu": "fdplug.plugins.cpu",
    "cuda": "fdplug.plugins.cuda",
    "xpu": "fdplug.plugins.xpu",
    "blackwell_moe": "fdplug.plugins.blackwell_moe",
    "storage_fs": "fdplug.plugins.storage_fs",
    "storage_bos": "fdplug.plugins.storage_bos",
}

REGISTRATION_HOOKS: dict[str, str] = {
    "fdplug_register_devices": "device",
    "fdplug_register_model_runners": "runner",
    "fdplug_register_attention_backends": "attention",
    "fdplug_register_moe_backends": "moe",
    "fdplug_register_ops": "op",
    "fdplug_register_feature_storages": "storage",
    "fdplug_register_kv_connectors": "kv_connector",
    "fdplug_register_settings": "setting",
    "fdplug_register_reasoning_parsers": "reasoning_parser",
    "fdplug_register_tool_parsers": "tool_parser",
}

LOADED, FAILED, DISABLED, NOT_ALLOWED = "loaded", "failed", "disabled", "not-allowed"


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """One plugin as ``fdplug plugins`` shows it."""

    name: str
    version: str
    source: str
    module: str
    status: str
    hooks: tuple[str, ...] = ()
    registered: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None
    traceback: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "source": self.source, "module": self.module,
                "status": self.status, "hooks": list(self.hooks), "registered": self.registered,
                "error": self.error}


@dataclass(frozen=True, slots=True)
class _Candidate:
    name: str
    source: str
    version: str
    module_name: str
    load: Callable[[], Any]
    third_party: bool


class PluginSet:
    """The outcome of one load: the pluggy manager, the registry, and a record per plugin seen."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.registry = Registry()
        self.infos: dict[str, PluginInfo] = {}
        self.warnings: list[str] = []

    def plugins(self) -> list[PluginInfo]:
        return list(self.infos.values())

    def failed(self) -> list[PluginInfo]:
        return [info for info in self.infos.values() if info.status == FAILED]

    def configure(self, config: Any, selection: Any) -> None:
        """Run every loaded plugin's ``fdplug_configure`` (one at a time, so a failure names its plugin)."""
        for impl in self.pm.hook.fdplug_configure.get_hookimpls():
            try:
                impl.function(config=config, selection=selection)
            except FdplugError:
                raise
            except Exception as exc:
                raise PluginError(f"plugin {impl.plugin_name!r} failed in fdplug_configure: "
                                  f"{type(exc).__name__}: {exc}",
                                  fix=f"report it to the plugin's authors, or disable it with "
                                      f"FDPLUG_DISABLE_PLUGINS={impl.plugin_name}.") from exc


_cache: dict[tuple, PluginSet] = {}
_current: PluginSet | None = None


def load_plugins(*, allow: Iterable[str] | None = None, deny: Iterable[str] | None = None,
                 strict: bool | None = None, extra: Iterable[tuple[str, Any]] = (),
                 reload: bool = False) -> PluginSet:
    """Load built-in and third-party plugins once and return the resulting `PluginSet`.

    ``allow`` (default ``FDPLUG_PLUGINS``) limits which third-party plugins load; ``deny`` (default
    ``FDPLUG_DISABLE_PLUGINS``) disables any plugin, built-ins included; ``strict`` (default
    ``FDPLUG_STRICT_PLUGINS``) makes any failure fatal. ``extra`` adds ``(name, plugin object)``
    pairs, as tests and embedding applications do. Calling again with the same arguments returns
    the same set; ``reload=True`` loads afresh (e.g. after installing a plugin).
    """
    global _current
    allow_list = env("FDPLUG_PLUGINS") if allow is None else tuple(allow)
    allow_set = None if allow_list is None else frozenset(allow_list)
    deny_set = frozenset(env("FDPLUG_DISABLE_PLUGINS") if deny is None else deny)
    strict_flag = env("FDPLUG_STRICT_PLUGINS") if strict is None else bool(strict)
    extra = tuple(extra)
    key = (allow_set, deny_set, strict_flag, tuple((n, id(p)) for n, p in extra))
    if not reload and key in _cache:
        _current = _cache[key]
        return _current
    plugin_set = PluginSet()
    candidates = [*_builtin_candidates(), *_entry_point_candidates(plugin_set), *_extra_candidates(extra)]
    for candidate in candidates:
        _load_one(plugin_set, candidate, allow_set, deny_set, strict_flag)
    if allow_set is not None:
        for name in sorted(allow_set - {c.name for c in candidates if c.third_party}):
            plugin_set.warnings.append(f"FDPLUG_PLUGINS names {name!r}, but no installed plugin has that name.")
    for warning in plugin_set.warnings:
        logger.warning(warning)
    _cache[key] = _current = plugin_set
    return plugin_set


def current_plugins() -> PluginSet:
    """The most recently loaded plugin set, loading with the environment's settings if none is."""
    return _current if _current is not None else load_plugins()


def list_plugins() -> list[PluginInfo]:
    """Every plugin seen by the current load, with version, source, hooks, status and error."""
    return current_plugins().plugins()


# ---------------------------------------------------------------------------------------------------
# candidates
# ---------------------------------------------------------------------------------------------------


def _fdplug_version() -> str:
    try:
        return importlib.metadata.version("fdplug")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _builtin_candidates() -> list[_Candidate]:
    version = _fdplug_version()
    core_name, core_module = CORE_PLUGIN
    core = _Candidate(core_name, "core", version, core_module, lambda: importlib.import_module(core_module), False)
    return [core, *(_Candidate(name, "builtin", version, module, lambda m=module: importlib.import_module(m), False)
                    for name, module in BUILTIN_PLUGINS.items())]


def _entry_point_candidates(plugin_set: PluginSet) -> list[_Candidate]:
    found = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        dist_name = dist.metadata["Name"] if dist is not None else "unknown distribution"
        version = dist.version if dist is not None else "unknown"
        found.append(_Candidate(ep.name, f"distribution {dist_name}", version, ep.value, ep.load, True))
    return sorted(found, key=lambda c: (c.name, c.source))


def _extra_candidates(extra: tuple[tuple[str, Any], ...]) -> list[_Candidate]:
    return [_Candidate(name, "programmatic", getattr(obj, "__version__", "0"), type(obj).__name__,
                       lambda o=obj: o, True) for name, obj in extra]


# ---------------------------------------------------------------------------------------------------
# loading one plugin
# ---------------------------------------------------------------------------------------------------


def _load_one(plugin_set: PluginSet, cand: _Candidate, allow: frozenset | None, deny: frozenset,
              strict: bool) -> None:
    def record(status: str, error: str | None = None, tb: str | None = None, hooks: tuple = (),
               registered: dict | None = None) -> None:
        plugin_set.infos[cand.name] = PluginInfo(cand.name, cand.version, cand.source, cand.module_name, status,
                                                 hooks, registered or {}, error, tb)

    if cand.name in plugin_set.infos:
        other = plugin_set.infos[cand.name]
        error = (f"duplicate plugin name {cand.name!r}: {cand.source} and {other.source} both provide it; "
                 f"the first one ({other.source}) is kept.")
        plugin_set.warnings.append(error)
        if strict:
            raise PluginError(error, fix="uninstall one of them.")
        return
    if cand.name in deny and cand.source != "core":
        return record(DISABLED, "disabled by FDPLUG_DISABLE_PLUGINS")
    if cand.third_party and allow is not None and cand.name not in allow:
        return record(NOT_ALLOWED, "not in FDPLUG_PLUGINS")
    plugin = None
    try:
        plugin = cand.load()
        _check_api_version(cand.name, plugin)
        plugin_set.pm.register(plugin, name=cand.name)
        hooks = _run_registration_hooks(plugin_set, cand.name)
    except Exception as exc:  # fault isolation: record, skip, go on (strict: fatal)
        if plugin is not None and plugin_set.pm.is_registered(plugin):
            plugin_set.pm.unregister(plugin)
        error = exc.message if isinstance(exc, FdplugError) else f"{type(exc).__name__}: {exc}"
        record(FAILED, error, traceback.format_exc())
        logger.warning("plugin %s (%s) failed to load: %s", cand.name, cand.source, error)
        if strict:
            raise PluginError(f"plugin {cand.name!r} ({cand.source}) failed to load: {error}",
                              fix="fix or uninstall it, or unset FDPLUG_STRICT_PLUGINS to skip it.") from exc
        return
    record(LOADED, hooks=hooks, registered=plugin_set.registry.by_plugin(cand.name))


def _check_api_version(name: str, plugin: Any) -> None:
    declared = getattr(plugin, "FDPLUG_API_VERSION", None)
    ours = hookspecs.API_VERSION
    if declared is None:
        raise PluginVersionError(f"plugin {name!r} does not declare FDPLUG_API_VERSION; fdplug's plugin API is {ours}.",
                                 fix=f'add FDPLUG_API_VERSION = "{ours}" to the plugin module once it works with it.')
    declared_major = str(declared).split(".")[0]
    if declared_major != ours.split(".")[0]:
        raise PluginVersionError(f"plugin {name!r} was written for fdplug plugin API {declared}, "
                                 f"but this fdplug provides API {ours}.",
                                 fix=f"install a release of {name!r} built for API {ours.split('.')[0]}.x, "
                                     "or an fdplug release that provides its API.")


def _run_registration_hooks(plugin_set: PluginSet, name: str) -> tuple[str, ...]:
    """Call this plugin's registration hooks with validating callbacks; commit all or nothing."""
    pm = plugin_set.pm
    plugin = pm.get_plugin(name)
    implemented = tuple(sorted(caller.name for caller in pm.get_hookcallers(plugin) or ()))
    unknown = [attr for attr in dir(plugin) if attr.startswith("fdplug_") and attr not in
               {spec for spec in dir(hookspecs) if spec.startswith("fdplug_")}]
    if unknown:
        raise PluginError(f"plugin {name!r} defines {', '.join(unknown)}, which is not an fdplug hook.",
                          fix="check the spelling against fdplug/plugin_api/hookspecs.py.")
    staging = plugin_set.registry.stage(name)
    for hook, role in REGISTRATION_HOOKS.items():
        for impl in getattr(pm.hook, hook).get_hookimpls():
            if impl.plugin_name == name:
                impl.function(register=staging.callback(role, hook))
    staging.commit()
    return implemented
