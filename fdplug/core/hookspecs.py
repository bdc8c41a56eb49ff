"""THE contract between the fdplug core and its plugins.

A plugin is a module (or object) with functions decorated by ``fdplug.hookimpl`` whose names are
the hooks below, and a module-level ``FDPLUG_API_VERSION = "1.0"`` naming the API it was written
for. Registration hooks are called once, when plugins load, with a ``register`` callback that
accepts one spec object (see `fdplug.core.specs`); the core validates what is registered, so a bad
registration fails loudly and only that plugin is skipped.

Selection happens once at startup (`fdplug.core.selection`); the hot path calls the selected objects
directly and never goes through pluggy.

Compatibility: a change that breaks an existing plugin bumps the major of ``API_VERSION``; adding a
hook or an optional spec field bumps the minor.
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

PROJECT_NAME = "fdplug"
API_VERSION = "1.0"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[Any], None]


# ===================================================================================================
# Devices
# ===================================================================================================


@hookspec
def fdplug_register_devices(register: Register) -> None:
    """Register the kinds of device this plugin drives.

    Call ``register(DeviceSpec(name=..., probe=..., paddle_device=..., priority=..., setup=...))``
    once per device. ``probe()`` answers whether the device is usable on this machine and why
    (``Probe(available, reason, fix, info)``); it runs when a device is selected or listed, never at
    registration. With ``--device auto`` the available device with the highest priority wins.

    Called once per process, when plugins are loaded.
    """


# ===================================================================================================
# Model runners
# ===================================================================================================


@hookspec
def fdplug_register_model_runners(register: Register) -> None:
    """Register model runners: the object that owns a device's model, KV cache and input batch.

    Call ``register(ModelRunnerSpec(name=..., devices=(...), factory=..., priority=..., supports=...))``.
    ``factory(config, backend)`` builds the runner for the selected `Backend`. The core registers a
    portable runner for every device; a plugin registers its own only when the device needs a
    different execution model (graphs, a vendor runtime).

    Called once per process, when plugins are loaded.
    """


# ===================================================================================================
# Attention backends
# ===================================================================================================


@hookspec
def fdplug_register_attention_backends(register: Register) -> None:
    """Register attention backends: paged-KV attention kernels and the masks they build.

    Call ``register(AttentionBackendSpec(name=..., devices=(...), factory=..., priority=..., supports=...))``.
    ``factory(config)`` returns a `fdplug.core.attention.AttentionBackend`: it chooses the KV cache
    layout, turns the core's mask spec (per query token, the exclusive end of its visible key range)
    into its kernel's mask once per step, and computes attention per layer.

    Called once per process, when plugins are loaded.
    """


# ===================================================================================================
# MoE backends
# ===================================================================================================


@hookspec
def fdplug_register_moe_backends(register: Register) -> None:
    """Register mixture-of-experts backends.

    Call ``register(MoEBackendSpec(name=..., devices=(...), weight_formats=(...), factory=..., ...))``.
    ``factory(config)`` returns a `fdplug.core.moe.MoEBackend`, which converts expert weights to its
    layout once at load time and computes routed experts per layer. ``weight_formats`` lists the
    checkpoint formats it can execute (``none``, ``fp8_block``, ...); selection rejects a backend
    that cannot run the model's format.

    Called once per process, when plugins are loaded.
    """


# ===================================================================================================
# Feature storages
# ===================================================================================================


@hookspec
def fdplug_register_feature_storages(register: Register) -> None:
    """Register storages that fetch pre-encoded multimodal features by URL.

    Call ``register(FeatureStorageSpec(name=..., schemes=("bos",), factory=..., priority=...))``.
    ``factory(config)`` returns a `fdplug.core.storage.FeatureStorage` with ``fetch(url)`` and
    ``fetch_many(urls, timeout=...)`` (results in the order given). The highest-priority storage of
    each scheme is selected.

    Called once per process, when plugins are loaded.
    """


# ===================================================================================================
# Configuration
# ===================================================================================================


@hookspec
def fdplug_configure(config: Any, backend: Any) -> None:
    """Validate or adjust the engine config for the selected backend.

    ``config`` is the `EngineConfig` (mutable at this point), ``backend`` the immutable `Backend`
    just selected. Act only if one of your components was selected (compare ``backend.device.name``
    etc.). Raise `fdplug.errors.ConfigError` with a ``fix=`` when a setting cannot work (for example
    a block size the kernel does not support).

    Called once, after selection and before the engine is built, in every process that builds one.
    """
