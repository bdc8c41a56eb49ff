"""The plugin ``core``: the portable components, registered for every device.

A device plugin that registers nothing but a device gets a working engine from these: the model
runner (`fdplug.core.worker.model_runner`), the reference attention and MoE and one kernel per op of
`fdplug.plugin_api.ops` (`fdplug.core.portable`), and the KV connectors ``shm`` and ``tcp``
(`fdplug.core.kv_transfer.connectors`), and the output parsers (`fdplug.core.parsers`). They are
correct anywhere and fast nowhere in particular: a
device plugin registers faster ones with a higher priority. The plugin loader registers this module
first, as the plugin ``core``, which cannot be disabled.
"""

from __future__ import annotations

from fdplug.core.portable.op_specs import PORTABLE_OPS, REFERENCE_BACKENDS
from fdplug.plugin_api.hookspecs import API_VERSION, hookimpl
from fdplug.plugin_api.specs import (
    ANY_DEVICE,
    KVConnectorSpec,
    ModelRunnerSpec,
)

FDPLUG_API_VERSION = API_VERSION


def _runner_factory(config, selection):
    from fdplug.core.worker.model_runner import ModelRunner

    return ModelRunner(config, selection)


@hookimpl
def fdplug_register_model_runners(register):
    register(ModelRunnerSpec(name="default", devices=(ANY_DEVICE,), factory=_runner_factory, priority=0,
                             weight_formats=("none", "fp8_block", "gguf"), structured_outputs=True,
                             description="the core's device-agnostic Paddle model runner (fp8_block and gguf linears: "
                                         "each dequantized when it runs)"))


@hookimpl
def fdplug_register_attention_backends(register):
    register(REFERENCE_BACKENDS["attention"])


@hookimpl
def fdplug_register_moe_backends(register):
    register(REFERENCE_BACKENDS["moe"])


@hookimpl
def fdplug_register_ops(register):
    for spec in PORTABLE_OPS.values():
        register(spec)


def _connector_factory(name: str):
    def factory(config, role, caches):
        from fdplug.core.kv_transfer import connectors

        return getattr(connectors, f"{name}_connector")(config, role, caches)
    return factory


@hookimpl
def fdplug_register_kv_connectors(register):
    register(KVConnectorSpec(name="shm", devices=(ANY_DEVICE,), factory=_connector_factory("shm"), priority=10,
                             description="a shared-memory arena (FDPLUG_KV_STAGING_MIB) read by a decode instance on "
                                         "this machine; TCP to one on another"))
    register(KVConnectorSpec(name="tcp", devices=(ANY_DEVICE,), factory=_connector_factory("tcp"), priority=0,
                             description="ZMQ over TCP (FDPLUG_KV_HOST), layer by layer, through host memory"))


@hookimpl
def fdplug_register_reasoning_parsers(register):
    from fdplug.core.parsers.reasoning import reasoning_specs

    for spec in reasoning_specs():
        register(spec)


@hookimpl
def fdplug_register_tool_parsers(register):
    from fdplug.core.parsers.tool_calls import tool_specs

    for spec in tool_specs():
        register(spec)
