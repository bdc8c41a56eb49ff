"""What selection produced: the device and one component per role, with every decision's reason.

Selection itself (the rules) is the core's (`fdplug.core.plugin_loading.selection`); plugins see the
result in ``fdplug_configure`` and in a runner's factory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fdplug.plugin_api.specs import (
    AttentionBackendSpec,
    DeviceSpec,
    FeatureStorageSpec,
    KVConnectorSpec,
    ModelRunnerSpec,
    MoEBackendSpec,
    OpSpec,
    Probe,
)

COMPONENT_ROLES = ("runner", "attention", "moe")
MEASURED_BACKENDS = ("attention", "moe")
"""The roles whose backend may be timed against the core's ``reference`` (`AttentionBackendSpec.measure_key`)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """Why one candidate was chosen or rejected for a role."""

    role: str
    name: str
    plugin: str
    chosen: bool
    reason: str

    def line(self) -> str:
        mark = "chosen  " if self.chosen else "rejected"
        return f"  {mark} {self.name} (plugin {self.plugin}): {self.reason}"


@dataclass(frozen=True, slots=True)
class Selection:
    """The selected device and components; the hot path calls these objects directly."""

    device: DeviceSpec
    probe: Probe
    runner: ModelRunnerSpec
    attention: AttentionBackendSpec
    moe: MoEBackendSpec
    ops: Mapping[str, OpSpec]
    storages: Mapping[str, FeatureStorageSpec]
    decisions: tuple[Decision, ...]
    kv_connector: KVConnectorSpec | None = None     # only for a prefill or decode instance (--role)
    measured_ops: frozenset[str] = frozenset()
    """The ops whose kernel was chosen by priority and names a ``measure_key``: the core times it
    against the portable op on the model's shapes (`OpSpec.measure_key`); and the roles of
    `MEASURED_BACKENDS` whose backend was, timed against the reference (API 4.7). Not those named
    explicitly."""

    def to_names(self) -> dict[str, Any]:
        """The choice as plain names: ``select_components(**names)`` rebuilds it in another process."""
        return {"device": self.device.name, "runner": self.runner.name, "attention": self.attention.name,
                "moe": self.moe.name, "ops": {op: spec.name for op, spec in self.ops.items()},
                "storages": {scheme: spec.name for scheme, spec in self.storages.items()},
                "kv_connector": self.kv_connector.name if self.kv_connector is not None else None,
                "measured_ops": sorted(self.measured_ops)}

    def summary(self) -> str:
        """One line: the chosen name of each role."""
        kv = f"kv_connector={self.kv_connector.name} " if self.kv_connector is not None else ""
        storages = ",".join(f"{scheme}:{spec.name}" for scheme, spec in self.storages.items()) or "none"
        return (f"device={self.device.name} runner={self.runner.name} attention={self.attention.name} "
                f"moe={self.moe.name} {kv}storages={storages}")

    def explain(self) -> str:
        """Every role's decisions, the chosen candidate first."""
        lines = []
        kv = ("kv_connector",) if self.kv_connector is not None else ()
        for role in ("device", *COMPONENT_ROLES, *(f"op:{op}" for op in self.ops), "storage", *kv):
            decisions = sorted((d for d in self.decisions if d.role == role), key=lambda d: not d.chosen)
            lines.append(f"{role}:")
            lines.extend(d.line() for d in decisions)
        return "\n".join(lines)
