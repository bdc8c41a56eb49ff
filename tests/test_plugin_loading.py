"""Loading: built-ins, entry points, allow/deny, strict, broken and mismatched plugins, duplicates."""

from __future__ import annotations

import pytest

from fdplug import API_VERSION, hookimpl
from fdplug.core.plugin_loading.loader import (
    BUILTIN_PLUGINS,
    list_plugins,
    load_plugins,
)
from fdplug.errors import PluginError
from fdplug.plugin_api.specs import SPEC_TYPES, AttentionBackendSpec, DeviceSpec, Probe
from tests.conftest import write_dist


def attention_spec(name, devices=("cpu",), priority=0, supports=None):
    return AttentionBackendSpec(name=name, devices=devices, factory=lambda config: None, priority=priority,
                                supports=supports)


class AttnPlugin:
    """A throwaway plugin registering one attention backend."""

    FDPLUG_API_VERSION = "4.0"

    def __init__(self, *specs):
        self.specs = specs

    @hookimpl
    def fdplug_register_attention_backends(self, register):
        for spec in self.specs:
            register(spec)


def test_builtins_load_and_report_what_they_registered():
    plugin_set = load_plugins()
    infos = {p.name: p for p in plugin_set.plugins()}
    assert set(BUILTIN_PLUGINS) <= set(infos)
    cpu = infos["cpu"]
    assert cpu.status == "loaded" and cpu.source == "builtin" and cpu.error is None
    assert cpu.registered["device"] == ["cpu"]
    assert "fdplug_register_devices" in cpu.hooks
    assert infos["cuda"].registered == {"device": ["cuda"]}


def test_loading_is_idempotent_and_reload_builds_afresh(site):
    first = load_plugins()
    assert load_plugins() is first
    fresh = load_plugins(reload=True)
    assert fresh is not first and fresh.registry is not first.registry
    assert first.registry.names("device")
    assert {role: fresh.registry.names(role) for role in SPEC_TYPES} == \
        {role: first.registry.names(role) for role in SPEC_TYPES}
    assert load_plugins() is fresh                  # the reload replaced the cached set
    assert [p.name for p in list_plugins()] == [p.name for p in fresh.plugins()]
    # a plugin installed after loading shows up on a reload, and only then
    write_dist(site, "fdplug-late", "1.0", {"late": "fdplug_late"}, {"fdplug_late": 'FDPLUG_API_VERSION = "4.0"\n'})
    assert "late" not in load_plugins().infos
    assert load_plugins(reload=True).infos["late"].status == "loaded"


def test_deny_list_disables_builtins_too(monkeypatch):
    monkeypatch.setenv("FDPLUG_DISABLE_PLUGINS", "xpu, cuda")
    plugin_set = load_plugins()
    assert plugin_set.infos["xpu"].status == "disabled"
    assert plugin_set.infos["cuda"].status == "disabled"
    assert plugin_set.registry.names("device") == ["cpu"]


def test_entry_point_plugin_is_discovered_with_its_distribution(site):
    write_dist(site, "fdplug-thing", "2.3.4", {"thing": "fdplug_thing"}, {"fdplug_thing": """
        from fdplug import hookimpl
        from fdplug.plugin_api.specs import DeviceSpec, Probe
        FDPLUG_API_VERSION = "4.0"
        @hookimpl
        def fdplug_register_devices(register):
            register(DeviceSpec(name="thing", probe=lambda: Probe(False, "no thing here", fix="buy one"),
                                paddle_device="thing"))
    """})
    info = load_plugins().infos["thing"]
    assert (info.status, info.version, info.source) == ("loaded", "2.3.4", "distribution fdplug-thing")
    assert info.registered == {"device": ["thing"]}


def test_allow_list_limits_third_party_but_not_builtins(site, monkeypatch):
    for name in ("alpha", "beta"):
        write_dist(site, f"fdplug-{name}", "1.0", {name: f"fdplug_{name}"},
                   {f"fdplug_{name}": 'FDPLUG_API_VERSION = "4.0"\n'})
    monkeypatch.setenv("FDPLUG_PLUGINS", "beta,gamma")
    plugin_set = load_plugins()
    assert plugin_set.infos["alpha"].status == "not-allowed"
    assert plugin_set.infos["beta"].status == "loaded"
    assert plugin_set.infos["cpu"].status == "loaded"
    assert any("'gamma'" in w for w in plugin_set.warnings)


def test_broken_plugin_is_recorded_and_skipped(site):
    write_dist(site, "fdplug-broken", "0.1", {"broken": "fdplug_broken"},
               {"fdplug_broken": "raise RuntimeError('vendor SDK missing: libfoo.so')\n"})
    plugin_set = load_plugins()
    info = plugin_set.infos["broken"]
    assert info.status == "failed"
    assert "RuntimeError: vendor SDK missing: libfoo.so" in info.error
    assert "Traceback" in info.traceback
    assert plugin_set.infos["cpu"].status == "loaded"
    assert plugin_set.failed() == [info]


def test_strict_mode_makes_a_broken_plugin_fatal(site, monkeypatch):
    write_dist(site, "fdplug-broken", "0.1", {"broken": "fdplug_broken"},
               {"fdplug_broken": "import does_not_exist_anywhere\n"})
    monkeypatch.setenv("FDPLUG_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="broken.*does_not_exist_anywhere"):
        load_plugins()


def test_api_major_mismatch_names_both_versions(site):
    write_dist(site, "fdplug-future", "9.0", {"future": "fdplug_future"},
               {"fdplug_future": 'FDPLUG_API_VERSION = "5.1"\n'})
    info = load_plugins().infos["future"]
    assert info.status == "failed"
    assert "API 5.1" in info.error and f"API {API_VERSION}" in info.error


def test_missing_api_version_is_refused():
    info = load_plugins(extra=[("anon", object())]).infos["anon"]
    assert info.status == "failed" and "FDPLUG_API_VERSION" in info.error


def test_duplicate_component_name_keeps_the_first_and_names_both():
    plugin_set = load_plugins(extra=[("one", AttnPlugin(attention_spec("fast"))),
                                     ("two", AttnPlugin(attention_spec("fast")))])
    assert plugin_set.infos["one"].status == "loaded"
    two = plugin_set.infos["two"]
    assert two.status == "failed" and "'one' already registered" in two.error and "'fast'" in two.error
    assert plugin_set.registry.get("attention", "fast").plugin == "one"


def test_duplicate_plugin_name_is_refused(site):
    write_dist(site, "fdplug-fake-cpu", "1.0", {"cpu": "fdplug_fake_cpu"},
               {"fdplug_fake_cpu": 'FDPLUG_API_VERSION = "4.0"\n'})
    plugin_set = load_plugins()
    assert plugin_set.infos["cpu"].source == "builtin"
    assert any("duplicate plugin name 'cpu'" in w for w in plugin_set.warnings)
    with pytest.raises(PluginError, match="duplicate plugin name"):
        load_plugins(strict=True, reload=True)


def test_registration_is_all_or_nothing_per_plugin():
    class HalfBroken:
        FDPLUG_API_VERSION = "4.0"

        @hookimpl
        def fdplug_register_devices(self, register):
            register(DeviceSpec(name="half", probe=lambda: Probe(True, "ok"), paddle_device="cpu"))

        @hookimpl
        def fdplug_register_attention_backends(self, register):
            register("not a spec")

    plugin_set = load_plugins(extra=[("half", HalfBroken())])
    info = plugin_set.infos["half"]
    assert info.status == "failed" and "expected a AttentionBackendSpec, got str" in info.error
    assert plugin_set.registry.get("device", "half") is None
    assert not plugin_set.pm.is_registered(HalfBroken) and plugin_set.pm.get_plugin("half") is None


def test_invalid_names_and_misspelled_hooks_are_refused():
    class Typo:
        FDPLUG_API_VERSION = "4.0"

        @hookimpl
        def fdplug_register_device(self, register):  # missing "s"
            pass

    plugin_set = load_plugins(extra=[("typo", Typo()), ("caps", AttnPlugin(attention_spec("Bad Name")))])
    assert "fdplug_register_device" in plugin_set.infos["typo"].error
    assert "must be lower-case" in plugin_set.infos["caps"].error


def test_configure_failures_name_their_plugin():
    class Grumpy:
        FDPLUG_API_VERSION = "4.0"

        @hookimpl
        def fdplug_configure(self, config, selection):
            raise KeyError("oops")

    from fdplug.core.config import EngineConfig
    from fdplug.core.plugin_loading.selection import select_components

    plugin_set = load_plugins(extra=[("grumpy", Grumpy())])
    with pytest.raises(PluginError, match="'grumpy' failed in fdplug_configure"):
        plugin_set.configure(EngineConfig(), select_components(plugins=plugin_set))


def test_weight_preparation_is_for_the_linear_ops_only():
    """``OpSpec.prepare`` (API 3.5): a callable, and only on ``linear`` / ``fp8_linear`` / ``gguf_linear``."""
    from fdplug.plugin_api.specs import OpSpec

    def plugin(spec):
        class One:
            FDPLUG_API_VERSION = "4.0"

            @hookimpl
            def fdplug_register_ops(self, register):
                register(spec)
        return One()

    kernel = lambda config: (lambda x: x)  # noqa: E731
    good = OpSpec(name="packed", op="fp8_linear", devices=("cpu",), factory=kernel, prepare=lambda config: None)
    wrong_op = OpSpec(name="norm_prep", op="rms_norm", devices=("cpu",), factory=kernel, prepare=lambda config: None)
    not_callable = OpSpec(name="bad_prep", op="linear", devices=("cpu",), factory=kernel, prepare="pack")
    plugin_set = load_plugins(extra=[("good", plugin(good)), ("wrong", plugin(wrong_op)),
                                     ("bad", plugin(not_callable))])
    assert plugin_set.infos["good"].status != "failed"
    assert "only linear, fp8_linear, gguf_linear kernels prepare weights" in plugin_set.infos["wrong"].error
    assert "prepare of 'bad_prep' must be callable" in plugin_set.infos["bad"].error
