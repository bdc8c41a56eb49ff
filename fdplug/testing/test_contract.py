"""Registration and probe contract of the device under test."""

from __future__ import annotations

from fdplug.core.plugin_loading.selection import run_probe
from fdplug.plugin_api.specs import DeviceSpec, Probe


def test_device_is_registered_by_a_loaded_plugin(fdplug_device, fdplug_plugin_set):
    entry = fdplug_plugin_set.registry.get("device", fdplug_device)
    assert entry is not None, (f"no device {fdplug_device!r} registered; loaded: "
                               f"{fdplug_plugin_set.registry.names('device')}; failed plugins: "
                               f"{[(p.name, p.error) for p in fdplug_plugin_set.failed()]}")
    assert isinstance(entry.spec, DeviceSpec)
    assert fdplug_plugin_set.infos[entry.plugin].status == "loaded"


def test_probe_answers_with_a_reason_and_is_stable(fdplug_device, fdplug_plugin_set):
    spec = fdplug_plugin_set.registry.get("device", fdplug_device).spec
    first, second = spec.probe(), spec.probe()
    assert isinstance(first, Probe), f"probe() returned {type(first).__name__}, not Probe"
    assert isinstance(first.reason, str) and first.reason.strip(), "probe() must say why"
    assert first.available == second.available, "probe() must be side-effect free and stable"
    assert first.available, f"device {fdplug_device!r} is not available here: {first.reason} (fix: {first.fix})"


def test_unavailable_probes_say_how_to_fix(fdplug_plugin_set):
    for entry in fdplug_plugin_set.registry.entries("device"):
        probe = run_probe(entry.spec)
        if not probe.available:
            assert probe.fix.strip(), f"device {entry.spec.name!r} is unavailable ({probe.reason}) without a fix"


def test_selection_picks_the_device_and_round_trips(fdplug_selection, fdplug_device, fdplug_plugin_set):
    from fdplug.core.plugin_loading.selection import select_components

    assert fdplug_selection.device.name == fdplug_device
    rebuilt = select_components(**fdplug_selection.to_names(), plugins=fdplug_plugin_set)
    assert rebuilt.to_names() == fdplug_selection.to_names()


def test_components_build(fdplug_selection):
    from fdplug.core.config import EngineConfig
    from fdplug.plugin_api.attention import AttentionBackend
    from fdplug.plugin_api.moe import MoEBackend

    assert isinstance(fdplug_selection.attention.factory(EngineConfig()), AttentionBackend)
    assert isinstance(fdplug_selection.moe.factory(EngineConfig()), MoEBackend)
