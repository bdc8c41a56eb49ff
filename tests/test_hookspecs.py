"""The contract itself: every role of the architecture has a typed hook, and only those."""

from __future__ import annotations

import inspect
import typing

import fdplug
from fdplug.core.plugin_loading.loader import REGISTRATION_HOOKS, load_plugins
from fdplug.plugin_api import hookspecs
from fdplug.plugin_api.specs import SPEC_TYPES, AttentionBackendSpec

EXPECTED_HOOKS = {
    "fdplug_register_devices", "fdplug_register_model_runners", "fdplug_register_attention_backends",
    "fdplug_register_moe_backends", "fdplug_register_ops", "fdplug_register_feature_storages",
    "fdplug_register_kv_connectors", "fdplug_register_settings", "fdplug_configure",
    "fdplug_register_reasoning_parsers", "fdplug_register_tool_parsers",
}


def hook_functions():
    return {name: fn for name, fn in vars(hookspecs).items() if name.startswith("fdplug_") and callable(fn)}


def test_exactly_the_architecture_hooks():
    assert set(hook_functions()) == EXPECTED_HOOKS
    assert all(hasattr(fn, "fdplug_spec") for fn in hook_functions().values())


def test_registration_hooks_are_typed_with_the_spec_they_take():
    """pytest-style typed hooks: ``register`` is a callback taking exactly the role's spec type."""
    for hook, role in REGISTRATION_HOOKS.items():
        fn = hook_functions()[hook]
        assert list(inspect.signature(fn).parameters) == ["register"]
        register = typing.get_type_hints(fn)["register"]
        assert typing.get_args(register) == ([SPEC_TYPES[role]], type(None)), hook
    assert set(REGISTRATION_HOOKS.values()) == set(SPEC_TYPES)


def test_configure_is_typed_with_the_config_view_and_the_selection():
    from fdplug.plugin_api.engine_config import EngineView
    from fdplug.plugin_api.selection import Selection

    hints = typing.get_type_hints(hookspecs.fdplug_configure, {"EngineView": EngineView, "Selection": Selection})
    assert hints["config"] is EngineView and hints["selection"] is Selection


def test_the_core_config_answers_every_question_of_the_view_a_plugin_reads():
    """`EngineView` is what the contract promises a plugin; the core's `EngineConfig` must keep it."""
    from fdplug.core.config import EngineConfig
    from fdplug.plugin_api.engine_config import EngineView

    promised = {name for name in vars(EngineView) if not name.startswith("_")}
    config = EngineConfig()
    assert len(promised) > 15 and {name for name in promised if not hasattr(config, name)} == set()
    assert config.kv_dtype() == config.dtype   # a method of the view, not a field


def versioned_plugin(version: str):
    """A throwaway plugin written for plugin API ``version``, registering one attention backend."""

    class Plugin:
        FDPLUG_API_VERSION = version

        @fdplug.hookimpl
        def fdplug_register_attention_backends(self, register):
            register(AttentionBackendSpec(name=f"attn_v{version.replace('.', '_')}", devices=("cpu",),
                                          factory=lambda config: None))

    return Plugin()


def test_api_version_and_reexports():
    """A newer minor only adds to the API, so its plugins load; another major is refused, naming both."""
    major, minor = (int(part) for part in hookspecs.API_VERSION.split("."))
    newer_minor, next_major, last_major = f"{major}.{minor + 1}", f"{major + 1}.0", f"{major - 1}.{minor}"
    infos = load_plugins(extra=[(f"v{v}", versioned_plugin(v)) for v in (newer_minor, next_major, last_major)]).infos
    assert infos[f"v{newer_minor}"].status == "loaded"
    assert infos[f"v{newer_minor}"].registered == {"attention": [f"attn_v{major}_{minor + 1}"]}
    for refused in (next_major, last_major):
        info = infos[f"v{refused}"]
        assert info.status == "failed" and not info.registered, refused
        assert f"API {refused}" in info.error and f"API {hookspecs.API_VERSION}" in info.error, info.error
    assert fdplug.hookimpl is hookspecs.hookimpl
    assert fdplug.API_VERSION == hookspecs.API_VERSION


def test_the_changelog_has_an_entry_for_every_minor_of_this_major():
    """A version bump comes with its line in plugin_api/CHANGELOG.md, newest first."""
    from pathlib import Path

    text = (Path(hookspecs.__file__).parent / "CHANGELOG.md").read_text()
    listed = [line.split("**")[1] for line in text.splitlines() if line.startswith("- **")]
    major, minor = map(int, hookspecs.API_VERSION.split("."))
    assert listed[0] == hookspecs.API_VERSION
    assert [f"{major}.{m}" for m in range(minor, -1, -1)] == [v for v in listed if v.startswith(f"{major}.")]
