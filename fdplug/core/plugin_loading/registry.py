"""The registry: every validated spec, by role and name, with the plugin that registered it.

Registration is transactional per plugin: a plugin's specs are staged while its hooks run and
committed only if all of them succeed, so a plugin that fails half-way leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fdplug.errors import RegistrationError
from fdplug.plugin_api.settings import SETTINGS, declare
from fdplug.plugin_api.spec_checks import validate_spec
from fdplug.plugin_api.specs import SPEC_TYPES


@dataclass(frozen=True, slots=True)
class Entry:
    """A registered spec and the plugin it came from."""

    spec: Any
    plugin: str


class Registry:
    """Specs by role (``device``, ``runner``, ``attention``, ``moe``, ``op``, ``storage``, ``setting``) and name."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Entry]] = {role: {} for role in SPEC_TYPES}

    def entries(self, role: str) -> list[Entry]:
        """Entries of a role, in registration order."""
        return list(self._entries[role].values())

    def get(self, role: str, name: str) -> Entry | None:
        return self._entries[role].get(name)

    def names(self, role: str) -> list[str]:
        return sorted(self._entries[role])

    def by_plugin(self, plugin: str) -> dict[str, list[str]]:
        """What one plugin registered: role -> names."""
        found = {role: [n for n, e in entries.items() if e.plugin == plugin] for role, entries in self._entries.items()}
        return {role: names for role, names in found.items() if names}

    def stage(self, plugin: str) -> Staging:
        return Staging(self, plugin)


class Staging:
    """Collects one plugin's registrations; ``commit`` adds them all or raises for the first conflict."""

    def __init__(self, registry: Registry, plugin: str) -> None:
        self._registry = registry
        self._plugin = plugin
        self._staged: list[tuple[str, Any]] = []

    def callback(self, role: str, hook: str) -> Callable[[Any], None]:
        """The ``register`` callback handed to one registration hook of this plugin."""
        expected = SPEC_TYPES[role]

        def register(spec: Any) -> None:
            try:
                validate_spec(spec, expected)
            except (TypeError, ValueError) as exc:
                raise RegistrationError(f"plugin {self._plugin!r}: {hook} registered an invalid {role}: {exc}.",
                                        fix=f"pass a {expected.__name__} from fdplug.plugin_api.specs.") from None
            if any(r == role and s.name == spec.name for r, s in self._staged):
                raise RegistrationError(f"plugin {self._plugin!r} registered {role} {spec.name!r} twice.",
                                        fix="register each name once.")
            self._staged.append((role, spec))

        return register

    def commit(self) -> None:
        for role, spec in self._staged:
            if role == "setting" and spec.name in SETTINGS and SETTINGS[spec.name] != spec:
                raise RegistrationError(f"plugin {self._plugin!r} registered setting {spec.name}, which fdplug or "
                                        "another plugin already declares differently.",
                                        fix="read the existing setting instead of declaring it again.")
            existing = self._registry.get(role, spec.name)
            if existing is not None:
                raise RegistrationError(
                    f"plugin {self._plugin!r} registered {role} {spec.name!r}, "
                    f"but plugin {existing.plugin!r} already registered that name.",
                    fix=f"rename it in one of the plugins, or disable one with FDPLUG_DISABLE_PLUGINS={self._plugin}.")
        for role, spec in self._staged:
            self._registry._entries[role][spec.name] = Entry(spec, self._plugin)
            if role == "setting":
                declare(spec)
