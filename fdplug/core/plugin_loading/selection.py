"""Choosing one implementation per role, once, at startup, with a reason for every candidate.

Rules: an explicit choice is strict (no fallback: if it cannot be used, that is the error);
otherwise the highest priority wins, then the name (alphabetical) breaks ties. A component must run
on the selected device and its ``supports(config)`` must not object. The resulting `Selection` is
immutable and serialises to names, so another process rebuilds the same choice with
``select_components(**selection.to_names())``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from fdplug.core.config import EngineConfig
from fdplug.core.parsers.chat_output import ChatParsers
from fdplug.core.plugin_loading.loader import PluginSet, current_plugins
from fdplug.core.plugin_loading.registry import Entry
from fdplug.core.settings import env
from fdplug.errors import ConfigError, DeviceUnavailableError, SelectionError, UnknownComponentError
from fdplug.plugin_api.ops import OPS
from fdplug.plugin_api.selection import COMPONENT_ROLES, MEASURED_BACKENDS, Decision, Selection
from fdplug.plugin_api.specs import DeviceSpec, FeatureStorageSpec, Probe

AUTO = "auto"


def select_components(device: str = AUTO, runner: str | None = None, attention: str | None = None,
                      moe: str | None = None, storages: Mapping[str, str] | None = None,
                      ops: Mapping[str, str] | None = None, kv_connector: str | None = None,
                      measured_ops: Iterable[str] | None = None, *,
                      config: EngineConfig | None = None, plugins: PluginSet | None = None) -> Selection:
    """Resolve device, runner, attention, MoE, op kernels and storages (and, for an instance with a
    ``config.kv_role``, its KV connector) into one immutable `Selection`.

    Raises `DeviceUnavailableError` (explicit device not usable here, with the probe's reason and
    fix), `UnknownComponentError` (no plugin registered that name) or `SelectionError` (no candidate
    fits); each carries the decisions made so far.

    ``measured_ops``: the ops whose kernel is timed against the portable op on the model's shapes, and
    the backend roles (``attention``, ``moe``) whose backend is timed against the reference
    (`Selection.measured_ops`); None: those chosen here by priority whose spec has a ``measure_key``,
    unless FDPLUG_OP_TIMING=0 (a list: how another process rebuilds a selection, whose ops it names).
    """
    plugins = plugins or current_plugins()
    config = config or EngineConfig()
    decisions: list[Decision] = []
    device_entry, probe = _select_device(plugins, device, decisions)
    asked_by = {"moe": "FD_MOE_BACKEND"} if moe is None and env("FD_MOE_BACKEND") else {}
    moe = moe if moe is not None else env("FD_MOE_BACKEND")
    chosen = {role: _select_component(plugins, role, explicit, device_entry.spec.name, config, decisions,
                                      asked_by=asked_by.get(role, "explicitly"))
              for role, explicit in zip(COMPONENT_ROLES, (runner, attention, moe))}
    op_specs = {op: _select_component(plugins, "op", (ops or {}).get(op), device_entry.spec.name, config,
                                      decisions, op=op) for op in OPS}
    storage_specs = select_storages(plugins, dict(storages or {}), decisions)
    if config.kv_role is None and kv_connector is not None:
        raise SelectionError(f"kv connector {kv_connector!r} was asked for, but this instance has no role.",
                             fix="add --role prefill or --role decode (a connector moves KV between the two).",
                             decisions=tuple(decisions))
    connector = (_select_component(plugins, "kv_connector", kv_connector, device_entry.spec.name, config, decisions)
                 if config.kv_role is not None else None)
    specs = {**op_specs, **{role: chosen[role] for role in MEASURED_BACKENDS}}   # what may be timed, by name
    if measured_ops is None:
        asked = {**(ops or {}), "attention": attention, "moe": moe}
        measured_ops = [name for name, spec in specs.items()
                        if spec.measure_key is not None and asked.get(name) is None and env("FDPLUG_OP_TIMING")]
    return Selection(device_entry.spec, probe, chosen["runner"], chosen["attention"], chosen["moe"],
                     MappingProxyType(op_specs), MappingProxyType(storage_specs), tuple(decisions), connector,
                     frozenset(name for name in measured_ops if name in specs and specs[name].measure_key is not None))


# ---------------------------------------------------------------------------------------------------
# device
# ---------------------------------------------------------------------------------------------------


def run_probe(spec: DeviceSpec) -> Probe:
    """A device's probe, isolated: a probe that raises reports the device unavailable, with why."""
    try:
        probe = spec.probe()
    except Exception as exc:
        return Probe(False, f"its probe raised {type(exc).__name__}: {exc}",
                     fix="report it to the plugin's authors; the device is treated as unavailable.")
    if not isinstance(probe, Probe):
        return Probe(False, f"its probe returned {type(probe).__name__}, not a Probe",
                     fix="report it to the plugin's authors.")
    return probe


def _select_device(plugins: PluginSet, name: str, decisions: list[Decision]) -> tuple[Entry, Probe]:
    registry = plugins.registry
    if name != AUTO:
        entry = registry.get("device", name)
        if entry is None:
            raise _unknown(plugins, "device", name, decisions)
        probe = run_probe(entry.spec)
        if not probe.available:
            decisions.append(Decision("device", name, entry.plugin, False, f"not available: {probe.reason}"))
            raise DeviceUnavailableError(f"device {name!r} was asked for explicitly but is not available: "
                                         f"{probe.reason}.", fix=probe.fix or None, decisions=tuple(decisions))
        decisions.append(Decision("device", name, entry.plugin, True, f"asked for explicitly; {probe.reason}"))
        for other in registry.entries("device"):
            if other.spec.name != name:
                decisions.append(Decision("device", other.spec.name, other.plugin, False,
                                          f"not probed: device {name!r} was asked for explicitly"))
        return entry, probe
    ranked = sorted(registry.entries("device"), key=lambda e: (-e.spec.priority, e.spec.name))
    winner: tuple[Entry, Probe] | None = None
    for entry in ranked:
        probe = run_probe(entry.spec)
        spec = entry.spec
        if not probe.available:
            reason = f"not available: {probe.reason}" + (f" (fix: {probe.fix})" if probe.fix else "")
            decisions.append(Decision("device", spec.name, entry.plugin, False, reason))
        elif winner is None:
            winner = (entry, probe)
            decisions.append(Decision("device", spec.name, entry.plugin, True,
                                      f"auto: the available device with the highest priority ({spec.priority}); "
                                      f"{probe.reason}"))
        else:
            decisions.append(Decision("device", spec.name, entry.plugin, False,
                                      f"available, but priority {spec.priority} is below "
                                      f"{winner[0].spec.name}'s {winner[0].spec.priority}"))
    if winner is None:
        raise SelectionError("no device is available.", fix="install a device plugin, or enable the cpu plugin "
                             "(remove it from FDPLUG_DISABLE_PLUGINS).", decisions=tuple(decisions))
    return winner


# ---------------------------------------------------------------------------------------------------
# runner, attention, MoE
# ---------------------------------------------------------------------------------------------------


# which weights each role executes: the routed experts (MoE backend), every other linear (runner)
_FORMAT_OF_ROLE = {"moe": "moe_weight_format", "runner": "linear_weight_format"}


def _rejection(spec: Any, device: str, config: EngineConfig) -> str | None:
    """Why a component cannot serve this device and config, or None if it can."""
    if not spec.runs_on(device):
        return f"runs on {', '.join(spec.devices)}, not on the selected device {device!r}"
    formats = getattr(spec, "weight_formats", None)
    if formats is not None and config.model is not None:
        wanted = getattr(config.model, _FORMAT_OF_ROLE[spec.role])
        if wanted not in formats:
            return f"executes weight formats {', '.join(formats)}, not the model's {wanted!r}"
    if spec.supports is None:
        return None
    try:
        reason = spec.supports(config)
    except Exception as exc:
        return f"supports() raised {type(exc).__name__}: {exc}"
    return None if reason is None else str(reason)


def _where_it_runs(plugins: PluginSet, spec: Any) -> str:
    """For a component asked for on a device it does not run on: whether its own devices are usable
    here (their probes' reasons) and what it says it needs (its description)."""
    parts = []
    for name in spec.devices:
        entry = plugins.registry.get("device", name)
        probe = run_probe(entry.spec) if entry is not None else None
        parts.append(f"{name}: " + ("no plugin registers it" if probe is None else
                                    ("available" if probe.available else f"not available here: {probe.reason}")))
    needs = f"; {spec.name}: {spec.description}" if spec.description else ""
    return f" ({'; '.join(parts)}{needs})"


def _select_component(plugins: PluginSet, role: str, explicit: str | None, device: str, config: EngineConfig,
                      decisions: list[Decision], op: str | None = None, asked_by: str = "explicitly") -> Any:
    """The component of ``role`` (for ``role == "op"``: the kernel of ``op``) for this device and config;
    ``asked_by`` says who named ``explicit`` (a flag, or a setting's name)."""
    registry = plugins.registry
    entries = [e for e in registry.entries(role) if op is None or e.spec.op == op]
    if op is not None:
        role = f"op:{op}"
    if explicit is not None:
        entry = next((e for e in entries if e.spec.name == explicit), None)
        if entry is None:
            raise _unknown(plugins, role, explicit, decisions)
        reason = _rejection(entry.spec, device, config)
        if reason is not None:
            decisions.append(Decision(role, explicit, entry.plugin, False, reason))
            if not entry.spec.runs_on(device):
                reason += _where_it_runs(plugins, entry.spec)
            raise SelectionError(f"{role} {explicit!r} was asked for {asked_by} but cannot be used: {reason}.",
                                 fix=f"choose another {role} (see `fdplug explain`) or another device.",
                                 decisions=tuple(decisions))
        decisions.append(Decision(role, explicit, entry.plugin, True, f"asked for {asked_by}"))
        for other in entries:
            if other.spec.name != explicit:
                decisions.append(Decision(role, other.spec.name, other.plugin, False,
                                          f"{explicit!r} was asked for {asked_by}"))
        return entry.spec
    chosen: Entry | None = None
    for entry in sorted(entries, key=lambda e: (-e.spec.priority, e.spec.name)):
        reason = _rejection(entry.spec, device, config)
        if reason is not None:
            decisions.append(Decision(role, entry.spec.name, entry.plugin, False, reason))
        elif chosen is None:
            chosen = entry
            decisions.append(Decision(role, entry.spec.name, entry.plugin, True,
                                      f"highest priority ({entry.spec.priority}) of those that fit device {device!r}"))
        else:
            decisions.append(Decision(role, entry.spec.name, entry.plugin, False,
                                      f"fits, but priority {entry.spec.priority} is below {chosen.spec.name}'s "
                                      f"{chosen.spec.priority}" if entry.spec.priority < chosen.spec.priority
                                      else f"fits, same priority as {chosen.spec.name}, which comes first by name"))
    if chosen is None:
        raise SelectionError(f"no {role} can run on device {device!r}: "
                             + ("; ".join(f"{d.name}: {d.reason}" for d in decisions if d.role == role)
                                or f"no plugin registered a {role}") + ".",
                             fix=f"install or enable a plugin that provides a {role} for {device!r}.",
                             decisions=tuple(decisions))
    return chosen.spec


# ---------------------------------------------------------------------------------------------------
# storages
# ---------------------------------------------------------------------------------------------------


def select_storages(plugins: PluginSet, explicit: Mapping[str, str] | None = None,
                    decisions: list[Decision] | None = None) -> dict[str, FeatureStorageSpec]:
    """The storage of each URL scheme: an explicit choice, else the highest priority, then the name."""
    registry = plugins.registry
    explicit = dict(explicit or {})
    decisions = [] if decisions is None else decisions
    for scheme, name in explicit.items():
        entry = registry.get("storage", name)
        if entry is None:
            raise _unknown(plugins, "storage", name, decisions)
        if scheme not in entry.spec.schemes:
            raise SelectionError(f"storage {name!r} was asked for scheme {scheme!r} but handles "
                                 f"{', '.join(entry.spec.schemes)}.", fix="pick a storage that handles it.",
                                 decisions=tuple(decisions))
    chosen: dict[str, FeatureStorageSpec] = {}
    for entry in sorted(registry.entries("storage"), key=lambda e: (-e.spec.priority, e.spec.name)):
        for scheme in entry.spec.schemes:
            wanted = explicit.get(scheme)
            if wanted is not None and wanted != entry.spec.name:
                reason = f"{scheme}://: {wanted!r} was asked for explicitly"
            elif scheme in chosen:
                reason = f"{scheme}://: {chosen[scheme].name} has priority over it"
            else:
                chosen[scheme] = entry.spec
                decisions.append(Decision("storage", entry.spec.name, entry.plugin, True,
                                          f"{scheme}://" + (": asked for explicitly" if wanted else "")))
                continue
            decisions.append(Decision("storage", entry.spec.name, entry.plugin, False, reason))
    return chosen


def _unknown(plugins: PluginSet, role: str, name: str, decisions: list[Decision]) -> UnknownComponentError:
    registry_role, _, op = role.partition(":")
    known = ", ".join(sorted(e.spec.name for e in plugins.registry.entries(registry_role)
                             if not op or e.spec.op == op)) or "none"
    failed = plugins.failed()
    disabled = [p.name for p in plugins.plugins() if p.status in ("disabled", "not-allowed")]
    message = f"no {role} named {name!r} is registered (known: {known})."
    if failed:
        message += " Plugins that failed to load, one of which may provide it: " + "; ".join(
            f"{p.name} ({p.source}): {p.error}" for p in failed) + "."
    if disabled:
        message += f" Disabled or not allowed: {', '.join(disabled)}."
    return UnknownComponentError(message, fix="install the plugin that provides it (`fdplug plugins` lists what is "
                                 "loaded), or fix the failure above.", decisions=tuple(decisions))


def select_parsers(plugins: PluginSet, reasoning: str | None = None, tools: str | None = None) -> ChatParsers:
    """The reasoning and tool parsers named at startup (``--reasoning-parser``, ``--tool-call-parser``)."""
    return ChatParsers(_parser(plugins, "reasoning_parser", reasoning, "--reasoning-parser"),
                       _parser(plugins, "tool_parser", tools, "--tool-call-parser"))


def _parser(plugins: PluginSet, role: str, name: str | None, flag: str) -> Any:
    if name is None:
        return None
    entry = plugins.registry.get(role, name)
    if entry is None:
        known = ", ".join(plugins.registry.names(role)) or "none"
        raise ConfigError(f"{flag} {name!r} is not a registered {role.replace('_', ' ')} (known: {known}).",
                          fix=f"name one of {known}, or install the plugin that registers {name!r}.")
    return entry.spec
