"""The checks every registration passes (`validate_spec`), apart from the spec types themselves
(`fdplug.plugin_api.specs`): what a plugin gets wrong is named at registration, not at the first step."""

from __future__ import annotations

import re
from typing import Any

from fdplug.plugin_api.ops import MEASURED_OPS, OPS, PREPARED_OPS
from fdplug.plugin_api.specs import (
    AttentionBackendSpec,
    ComponentSpec,
    DeviceSpec,
    FeatureStorageSpec,
    MoEBackendSpec,
    OpSpec,
    Setting,
)

_NAME_RE = re.compile(r"^[a-z][a-z0-9_\-]*$")
_ENV_NAME_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def validate_spec(spec: Any, expected: type) -> None:
    """Raise TypeError/ValueError describing what is wrong with a registration, if anything."""
    if not isinstance(spec, expected):
        raise TypeError(f"expected a {expected.__name__}, got {type(spec).__name__}")
    if isinstance(spec, Setting):
        return _validate_setting(spec)
    if not isinstance(spec.name, str) or not _NAME_RE.match(spec.name):
        raise ValueError(f"name {spec.name!r} must be lower-case letters, digits, '_' or '-', "
                         "starting with a letter")
    if not isinstance(getattr(spec, "priority", 0), int):
        raise TypeError(f"priority of {spec.name!r} must be an int, got {type(spec.priority).__name__}")
    if isinstance(spec, DeviceSpec):
        _require_callable(spec, "probe")
        if spec.setup is not None:
            _require_callable(spec, "setup")
    else:
        _require_callable(spec, "factory")
    if isinstance(spec, ComponentSpec):
        if isinstance(spec.devices, str) or not spec.devices:
            raise TypeError(f"devices of {spec.name!r} must be a non-empty tuple of device names")
        if spec.supports is not None:
            _require_callable(spec, "supports")
    if isinstance(spec, OpSpec) and spec.op not in OPS:
        raise ValueError(f"op {spec.op!r} of {spec.name!r} is not one of {', '.join(OPS)}")
    if isinstance(spec, OpSpec) and spec.bf16_inputs is not False and (
            spec.bf16_inputs is not True or spec.op not in ("linear", "gguf_linear")):
        raise ValueError(f"bf16_inputs of {spec.name!r} must be a bool, and True only for the 'linear' and "
                         "'gguf_linear' ops")
    # (imported here, not with the contract: gguf_formats imports numpy, whose threads must start
    # after the engine process sets its scheduler slice)
    from fdplug.plugin_api.gguf_formats import Q8_RUNS

    if isinstance(spec, OpSpec) and spec.q8_inputs is not False and (
            not (spec.q8_inputs is True or (type(spec.q8_inputs) is int and spec.q8_inputs in Q8_RUNS))
            or spec.op != "gguf_linear" or spec.bf16_inputs):
        raise ValueError(f"q8_inputs of {spec.name!r} must be False, True (runs of 4) or a run length of "
                         f"{', '.join(map(str, Q8_RUNS))}, and set only for a 'gguf_linear' op without bf16_inputs")
    if isinstance(spec, OpSpec) and spec.measure_key is not None:
        _require_callable(spec, "measure_key")
        if spec.op not in MEASURED_OPS:
            raise ValueError(f"measure_key of {spec.name!r}: only {', '.join(MEASURED_OPS)} kernels are timed "
                             "against the portable op")
    if isinstance(spec, (AttentionBackendSpec, MoEBackendSpec)) and spec.measure_key is not None:
        _require_callable(spec, "measure_key")
    if isinstance(spec, OpSpec) and spec.prepare is not None:
        _require_callable(spec, "prepare")
        if spec.op not in PREPARED_OPS:
            raise ValueError(f"prepare of {spec.name!r}: only {', '.join(PREPARED_OPS)} kernels prepare weights")
    if isinstance(spec, DeviceSpec) and (isinstance(spec.dtypes, str) or not spec.dtypes):
        raise TypeError(f"dtypes of {spec.name!r} must be a non-empty tuple such as ('float32',)")
    if isinstance(spec, FeatureStorageSpec):
        if isinstance(spec.schemes, str) or not spec.schemes:
            raise TypeError(f"schemes of {spec.name!r} must be a non-empty tuple such as ('file',)")


def _require_callable(spec: Any, attr: str) -> None:
    if not callable(getattr(spec, attr)):
        raise TypeError(f"{attr} of {spec.name!r} must be callable")


def _validate_setting(spec: Setting) -> None:
    if not isinstance(spec.name, str) or not _ENV_NAME_RE.match(spec.name):
        raise ValueError(f"setting name {spec.name!r} must be an environment variable name (A-Z, 0-9, _)")
    if not callable(spec.parse):
        raise TypeError(f"parse of {spec.name!r} must be callable")
    if not isinstance(spec.help, str) or not spec.help:
        raise ValueError(f"setting {spec.name!r} needs a help text (fdplug doctor and docs/configuration.md show it)")
