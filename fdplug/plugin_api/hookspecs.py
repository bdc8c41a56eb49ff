"""The hooks: what a plugin implements. Read with `fdplug.plugin_api.specs` (what it registers).

A plugin is a module (or object) with functions decorated by ``fdplug.hookimpl`` whose names are
the hooks below, and a module-level ``FDPLUG_API_VERSION = "4.8"`` naming the API it was written
for. Registration hooks are called once, when plugins load, with a ``register`` callback that
accepts one spec object; the core validates what is registered, so a bad registration fails loudly
and only that plugin is skipped.

Selection happens once at startup (`fdplug.core.plugin_loading.selection`); the hot path calls the
selected objects directly and never goes through pluggy.

Compatibility: a change that breaks an existing plugin bumps the major of ``API_VERSION``; adding a
hook or an optional spec field bumps the minor. What each version added: `CHANGELOG.md`
beside this file.
"""

from __future__ import annotations

# typing.Callable, not collections.abc's: get_type_hints() on a hook gives Callable[[Spec], NoneType] with it
# (collections.abc keeps a bare None in get_args), and the typed-hook contract is checked that way.
from typing import TYPE_CHECKING, Callable  # noqa: UP035

import pluggy

from fdplug.plugin_api.parsers import ReasoningParserSpec, ToolParserSpec
from fdplug.plugin_api.settings import Setting
from fdplug.plugin_api.specs import (
    AttentionBackendSpec,
    DeviceSpec,
    FeatureStorageSpec,
    KVConnectorSpec,
    ModelRunnerSpec,
    MoEBackendSpec,
    OpSpec,
)

if TYPE_CHECKING:
    from fdplug.plugin_api.engine_config import EngineView
    from fdplug.plugin_api.selection import Selection

PROJECT_NAME = "fdplug"
API_VERSION = "4.8"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def fdplug_register_devices(register: Callable[[DeviceSpec], None]) -> None:
    """Register the kinds of device this plugin drives: ``register(DeviceSpec(...))`` once per device.

    ``probe()`` answers whether the device is usable on this machine and why; it runs when a device
    is selected or listed, never at registration. With ``--device auto`` the available device with
    the highest priority wins. A device needs nothing else: the core's portable runner, attention,
    MoE and op kernels run on every device through Paddle.
    """


@hookspec
def fdplug_register_model_runners(register: Callable[[ModelRunnerSpec], None]) -> None:
    """Register model runners (`fdplug.plugin_api.model_runner.ModelRunner`).

    ``factory(config, selection)`` builds the runner. The core registers a portable runner for every
    device; register your own only when the device needs a different execution model (graphs, a
    vendor runtime). A faster kernel for one op is an `OpSpec`, not a runner.
    """


@hookspec
def fdplug_register_attention_backends(register: Callable[[AttentionBackendSpec], None]) -> None:
    """Register attention backends (`fdplug.plugin_api.attention.AttentionBackend`).

    ``factory(config)`` returns the backend: it chooses the KV cache layout, turns the core's mask
    spec (per query token, the exclusive end of its visible key range) into its kernel's mask once
    per step, and computes attention per layer.
    """


@hookspec
def fdplug_register_moe_backends(register: Callable[[MoEBackendSpec], None]) -> None:
    """Register mixture-of-experts backends (`fdplug.plugin_api.moe.MoEBackend`).

    ``factory(config)`` returns the backend, which converts expert weights to its layout once at
    load time and computes routed experts per layer. ``weight_formats`` lists the checkpoint formats
    it can execute (``none``, ``fp8_block``, ...); selection rejects one that cannot run the model's.
    """


@hookspec
def fdplug_register_ops(register: Callable[[OpSpec], None]) -> None:
    """Register faster kernels for single ops of the portable model (`fdplug.plugin_api.ops`).

    ``register(OpSpec(op="swiglu", name=..., devices=(...), factory=..., priority=...))``:
    ``factory(config)`` returns a callable with the op's contract. The core registers a portable
    Paddle implementation of every op; the highest-priority one that fits the device wins.
    """


@hookspec
def fdplug_register_feature_storages(register: Callable[[FeatureStorageSpec], None]) -> None:
    """Register storages that fetch pre-encoded multimodal features by URL
    (`fdplug.plugin_api.storage.FeatureStorage`); the highest-priority storage of each scheme wins."""


@hookspec
def fdplug_register_kv_connectors(register: Callable[[KVConnectorSpec], None]) -> None:
    """Register KV connectors (`fdplug.plugin_api.kv_connector`): how a request's KV blocks move
    from a prefill instance to a decode instance (``fdplug serve --role``).

    ``factory(config, role, caches)`` returns a ``KVSender`` (role ``prefill``) or a ``KVReceiver``
    (``decode``) over the engine's ``KVCaches``. The core registers ``tcp`` (any two machines) and
    ``shm`` (the same machine through shared memory, else TCP); register yours with a higher
    priority for a faster transport (RDMA, NVLink, a chip's DMA). The core keeps the scheduling and
    every deadline; the conformance kit runs the same transfer tests on every connector.
    """


@hookspec
def fdplug_register_reasoning_parsers(register: Callable[[ReasoningParserSpec], None]) -> None:
    """Register reasoning parsers (`fdplug.plugin_api.parsers`): how a thinking model's reasoning is
    told from its answer (``fdplug serve --reasoning-parser NAME``). The core registers ``qwen3``,
    ``deepseek_r1``, ``ernie`` and ``glm45``; names are unique across plugins."""


@hookspec
def fdplug_register_tool_parsers(register: Callable[[ToolParserSpec], None]) -> None:
    """Register tool-call parsers (`fdplug.plugin_api.parsers`): how a model writes function calls
    (``fdplug serve --enable-auto-tool-choice --tool-call-parser NAME``). The core registers
    ``hermes``, ``ernie``, ``glm45`` and ``llama3_json``; names are unique across plugins."""


@hookspec
def fdplug_register_settings(register: Callable[[Setting], None]) -> None:
    """Register the environment variables this plugin reads (`fdplug.plugin_api.settings.Setting`).

    Read them with ``setting.value()``. Registered settings are listed by ``fdplug doctor`` and must
    appear in docs/configuration.md's table of variables (checked by a test for built-in plugins).
    """


@hookspec
def fdplug_configure(config: EngineView, selection: Selection) -> None:
    """Check the engine config against the selection just made.

    Both are read-only: ``config`` is the core's, read through `EngineView`. Act only if one of your components
    was selected (compare ``selection.device.name`` etc.). Raise `fdplug.errors.ConfigError` with a
    ``fix=`` when a setting cannot work (for example a block size the kernel does not support).

    Called once, after selection and before the engine is built, in every process that builds one.
    """
