"""The hooks: what a plugin implements. Read with `fdplug.plugin_api.specs` (what it registers).

A plugin is a module (or object) with functions decorated by ``fdplug.hookimpl`` whose names are
the hooks below, and a module-level ``FDPLUG_API_VERSION = "3.14"`` naming the API it was written
for. Registration hooks are called once, when plugins load, with a ``register`` callback that
accepts one spec object; the core validates what is registered, so a bad registration fails loudly
and only that plugin is skipped.

Selection happens once at startup (`fdplug.core.plugin_loading.selection`); the hot path calls the
selected objects directly and never goes through pluggy.

Compatibility: a change that breaks an existing plugin bumps the major of ``API_VERSION``; adding a
hook or an optional spec field bumps the minor. 2.0: ``fdplug_configure`` and runner factories take
the `Selection` (was ``backend``); settings and op kernels are registered through hooks. 3.0: the core
routes (`fdplug.plugin_api.moe.select_experts` with a `Routing`), so ``MoEBackend.forward`` takes the
chosen ``(topk_weights, topk_ids)`` instead of the router logits. 3.1: the ``fp8_linear`` op,
``ModelRunnerSpec.weight_formats`` (the linear layers' formats a runner executes) and `ModelTraits`
fields for weight formats and shapes; FP8 formats in `fdplug.plugin_api.fp8`. 3.2: the ``linear``
op (every float linear layer, weights ``[N, K]``, bf16 weights allowed) and ``EngineConfig.weight_dtype``.
3.3: ``OpSpec.bf16_inputs``: a ``linear`` kernel that computes bf16 weights in bf16 math. 3.4: the
``add_rms_norm``, ``rope`` and ``argmax`` ops (a plugin written for 3.3 gets the portable ones). 3.5:
``OpSpec.prepare``: a ``linear`` kernel lays out each layer's weight its own way once at load
(`fdplug.plugin_api.ops.PreparedWeight`). 3.6: expert parallel: `fdplug.plugin_api.moe.ExpertExchange`
and `ExpertBatch`, and an optional ``MoEBackend.make_exchange`` (a backend's own dispatch/combine).
3.7: ``AttentionBackend.kv_cache_layout`` (optional): where a KV block lives in the cache
(`fdplug.plugin_api.kv_layout`), for moving KV between instances. 3.8: ``fdplug_register_kv_connectors``
(`fdplug.plugin_api.kv_connector`): how KV moves between prefill and decode instances. 3.9:
`fdplug.plugin_api.kv_connector.KVConnChecker` (a receiver's ``check(conn)``, which a decode
instance without ``FDPLUG_PD_SECRET`` requires) and ``KVCaches.peers``. 3.10: ``OpSpec.measure_key``
(``linear``): a kernel timed against the portable op on the model's layer shapes, used only where it
is not slower (`fdplug.core.plugin_loading.op_timing`); ``Selection.measured_ops``. 3.11: the
``gguf_linear`` op (a GGUF file's linears in GGML blocks, `fdplug.core.quant.gguf_blocks`), the ``gguf``
weight format and ``ModelTraits.weight_types`` (a plugin written for 3.10 gets the portable op). 3.12:
the ``decoder_stack`` op (every decoder layer of a step in one call of the plugin's own, handed a
`fdplug.plugin_api.decoder_stack.DecoderStack` at load; the portable op runs the layers one by one).
3.13: ``OpSpec.bf16_inputs`` for ``gguf_linear`` kernels too (bf16 math on the decoded weights); the
``gguf`` expert weight format (a GGUF file's routed experts in GGML blocks, ``ExpertWeights.qtypes``);
``EngineConfig.kv_cache_dtype`` (the cache's element type, ``KVCachePlan.dtype``; a backend that cannot
read another than the compute dtype refuses it in ``supports``). 3.14: ``OpSpec.q8_inputs``: a
``gguf_linear`` kernel in q8 math (its inputs quantized to 8 bits per 4 values, as llama.cpp's;
`fdplug.plugin_api.gguf_formats.q8_inputs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pluggy

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
    from fdplug.core.config import EngineConfig
    from fdplug.plugin_api.selection import Selection

PROJECT_NAME = "fdplug"
API_VERSION = "3.14"

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
def fdplug_register_settings(register: Callable[[Setting], None]) -> None:
    """Register the environment variables this plugin reads (`fdplug.plugin_api.settings.Setting`).

    Read them with ``setting.value()``. Registered settings are listed by ``fdplug doctor`` and must
    appear in docs/configuration.md's table of variables (checked by a test for built-in plugins).
    """


@hookspec
def fdplug_configure(config: "EngineConfig", selection: "Selection") -> None:
    """Validate or adjust the engine config for the selection just made.

    ``config`` is mutable at this point, ``selection`` is not. Act only if one of your components
    was selected (compare ``selection.device.name`` etc.). Raise `fdplug.errors.ConfigError` with a
    ``fix=`` when a setting cannot work (for example a block size the kernel does not support).

    Called once, after selection and before the engine is built, in every process that builds one.
    """
