"""Settings: the one place fdplug reads environment variables, and the registry that lists them.

Every variable is a `Setting`, declared by whoever owns it: the core and the server declare theirs
in their ``settings`` modules, and a plugin hands its own to the ``fdplug_register_settings`` hook
(see `fdplug.plugin_api.hookspecs`). ``fdplug doctor`` lists every registered setting and
docs/configuration.md's table is checked against the registry by a test, so nothing reads
``os.environ`` behind the user's back. Names follow FastDeploy where the concept is the same.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdplug.errors import ConfigError

# Variables that libraries also write (``import paddle`` sets OMP_NUM_THREADS=1 when it is unset) are
# read as they were when fdplug was imported, so a library's write is not mistaken for the user's.
_PADDLE_IMPORTED_FIRST = "paddle" in sys.modules
_STARTUP_ENV = dict(os.environ)


@dataclass(frozen=True, slots=True)
class Setting:
    """One environment variable: its default, how to parse it, and what it means.

    ``secret`` values are never shown (``<hidden>``); ``as_set_by_user`` reads the value as it was
    when fdplug was imported (for variables a library may write itself).
    """

    name: str
    default: Any
    parse: Callable[[str], Any]
    help: str
    secret: bool = False
    as_set_by_user: bool = False

    def value(self) -> Any:
        """The parsed value, or the default when unset; a malformed value is a ConfigError naming it."""
        raw = self.raw()
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:   # a parser's message may quote the value: never for a secret
            why = "it does not parse" if self.secret else str(exc)
            shown = "<hidden>" if self.secret else repr(raw)
            raise ConfigError(f"environment variable {self.name}={shown} is invalid: {why}.",
                              fix=f"{self.help} Unset it or give a valid value.") from None

    def is_set(self) -> bool:
        """Whether the user set it (even to an empty string)."""
        return self.raw() is not None

    def raw(self) -> str | None:
        if not self.as_set_by_user:
            return os.environ.get(self.name)
        if _PADDLE_IMPORTED_FIRST and self.name == "OMP_NUM_THREADS":
            return None  # paddle may have written it: its origin is unknown
        return _STARTUP_ENV.get(self.name)


SETTINGS: dict[str, Setting] = {}
"""Every declared setting by name: the core's and the server's on import, plugins' when they load."""


def declare(setting: Setting) -> Setting:
    """Add a setting to the registry (the same setting twice is fine; two different ones are not)."""
    existing = SETTINGS.get(setting.name)
    if existing is not None and existing != setting:
        raise ValueError(f"setting {setting.name} is declared twice, differently")
    SETTINGS[setting.name] = setting
    return setting


def env(name: str) -> Any:
    """The parsed value of a declared setting, by name."""
    return _declared(name).value()


def env_is_set(name: str) -> bool:
    """Whether the user set a declared setting."""
    return _declared(name).is_set()


def _declared(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared setting (declare it with fdplug.plugin_api.settings.declare, "
                       "or register it from a plugin's fdplug_register_settings)") from None


def cache_dir() -> Path:
    """Where fdplug and its plugins keep generated files (compiled kernels, ...): FDPLUG_CACHE_DIR."""
    return Path(CACHE_DIR.value() or "~/.cache/fdplug").expanduser()


# ---------------------------------------------------------------------------------------------------
# parsers
# ---------------------------------------------------------------------------------------------------


def parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 1/0/true/false, got {raw!r}")


def parse_list(raw: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def parse_paths(raw: str) -> tuple[str, ...]:
    return tuple(item for item in raw.split(os.pathsep) if item)


def parse_positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def parse_positive_float(raw: str) -> float:
    value = float(raw)
    if value <= 0:
        raise ValueError(f"must be > 0, got {value}")
    return value


def parse_choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {raw!r}")
        return value
    return parse


CACHE_DIR = declare(Setting("FDPLUG_CACHE_DIR", None, str,
                            "Directory for fdplug's generated files, e.g. compiled kernels "
                                "(default: ~/.cache/fdplug)."))
OMP_NUM_THREADS = declare(Setting("OMP_NUM_THREADS", None, parse_positive_int,
                                  "Honoured if set before fdplug and paddle are imported: CPU compute then uses that "
                                  "many threads.", as_set_by_user=True))
