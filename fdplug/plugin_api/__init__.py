"""fdplug's plugin API: everything a plugin author imports, and nothing else.

A plugin is a module with ``FDPLUG_API_VERSION = "4.8"`` and functions decorated with ``hookimpl``,
found through the ``fdplug`` entry-point group (``[project.entry-points.fdplug] mychip =
"fdplug_mychip"``). Its hooks (`hookspecs`) each receive a ``register`` callback taking one spec
(`specs`). The smallest useful plugin registers one `DeviceSpec`; the core's portable runner,
attention, MoE and op kernels then run on it through Paddle (see docs/plugins.md, "Writing a plugin").

What you may register, and the contract each object keeps:

==================  ======================  ===================================================
hook                spec                    the object its factory returns
==================  ======================  ===================================================
register_devices    `DeviceSpec`            (a probe answering `Probe`; ``setup``; ``dtypes``)
register_ops        `OpSpec`                a kernel for one op (`ops`: ``linear``, ``rms_norm``, ...)
register_attention  `AttentionBackendSpec`  `AttentionBackend` (`attention`: mask spec, KV layout)
register_moe        `MoEBackendSpec`        `MoEBackend` (`moe`: routing rule, expert weights)
register_runners    `ModelRunnerSpec`       `ModelRunner` (`model_runner`): only for a different
                                            execution model (graphs, a vendor runtime)
register_storages   `FeatureStorageSpec`    `FeatureStorage` (`storage`: bytes by URL, in order)
register_kv_conn..  `KVConnectorSpec`       `KVSender` / `KVReceiver` (`kv_connector`: moving KV
                                            blocks between prefill and decode instances)
register_settings   `Setting`               (your environment variables; `settings`)
register_reasoning  `ReasoningParserSpec`   `ReasoningParser` (`parsers`: reasoning vs answer text)
register_tool_pars  `ToolParserSpec`        `ToolParser` (`parsers`: a model's tool calls in its text)
configure           --                      refuse the engine config (`EngineView`) for the `Selection`
==================  ======================  ===================================================

Selection (`selection`) happens once at startup: per role the highest priority that runs on the
device and whose ``supports(config)`` does not object; explicit choices are strict. ``fdplug
explain`` prints every decision with its reason. Errors (`fdplug.errors`) carry a ``fix=``: raise
`ConfigError` from ``supports``/``configure``, `RequestStepError` from a runner that knows which
requests broke a step. What a component is handed: `EngineView` (the engine configuration, read-only,
with the model's `ModelTraits`: `engine_config`); a runner, each step's `SchedulerOutput`
(`scheduled_work`, with each request's `SamplingParams`). One definition for every plugin:
`fp8` holds the FP8 formats (block quantization, UE8M0, the SM100 scale layout) every FP8 kernel
and the core share; `gguf_formats` the GGML block types a ``gguf_linear`` kernel reads. Helpers:
`import_paddle`, `cache_dir`; implementation a plugin may build on (a device probe of the usual
shape, parallel downloads in order, KV block copies, the MoE routing rule) is the core's portable
components' (`fdplug.core.portable`), which a plugin may import.

The conformance kit (`fdplug.testing`, a pytest plugin) checks a plugin's components against the
portable ones. Modules here import nothing from ``fdplug.core``, ``fdplug.server`` or
``fdplug.plugins`` at run time; the core and the plugins import from here.
"""

from __future__ import annotations

import importlib

from fdplug.plugin_api.hookspecs import API_VERSION, hookimpl

# Everything else is imported on first use: ``import fdplug`` stays light (no numpy, no paddle), and
# the engine process can set its scheduler slice before numpy's BLAS starts its threads.
_EXPORTS = {
    "ConfigError": "fdplug.errors", "FdplugError": "fdplug.errors", "RequestStepError": "fdplug.errors",
    "AttentionBackend": "fdplug.plugin_api.attention", "AttentionMetadata": "fdplug.plugin_api.attention",
    "causal_key_end": "fdplug.plugin_api.attention", "cdiv": "fdplug.plugin_api.attention",
    "KVCachePlan": "fdplug.plugin_api.model_runner", "ModelInfo": "fdplug.plugin_api.model_runner",
    "ModelRunner": "fdplug.plugin_api.model_runner", "ModelRunnerOutput": "fdplug.plugin_api.model_runner",
    "ExpertWeights": "fdplug.plugin_api.moe", "MoEBackend": "fdplug.plugin_api.moe",
    "ExpertBatch": "fdplug.plugin_api.moe", "ExpertExchange": "fdplug.plugin_api.moe",
    "ExpertsFailedError": "fdplug.plugin_api.moe",
    "OPS": "fdplug.plugin_api.ops", "Kernels": "fdplug.plugin_api.ops", "PreparedWeight": "fdplug.plugin_api.ops",
    "PREPARED_OPS": "fdplug.plugin_api.ops",
    **dict.fromkeys(("DecoderStack", "StackLayer", "StackLinear"), "fdplug.plugin_api.decoder_stack"),
    **dict.fromkeys(("BLOCK_FORMATS", "BlockFormat", "format_of", "row_bytes"), "fdplug.plugin_api.gguf_formats"),
    "import_paddle": "fdplug.plugin_api.paddle",
    "layout_of": "fdplug.plugin_api.kv_layout",
    **dict.fromkeys(("KVCaches", "KVConnChecker", "KVReceiver", "KVSender"), "fdplug.plugin_api.kv_connector"),
    "Decision": "fdplug.plugin_api.selection", "Selection": "fdplug.plugin_api.selection",
    "Setting": "fdplug.plugin_api.settings", "cache_dir": "fdplug.plugin_api.settings",
    **dict.fromkeys(("ANY_DEVICE", "AttentionBackendSpec", "DeviceSpec", "FeatureStorageSpec", "KVConnectorSpec",
                     "ModelRunnerSpec", "MoEBackendSpec", "OpSpec", "Probe"), "fdplug.plugin_api.specs"),
    "FeatureStorage": "fdplug.plugin_api.storage", "display_url": "fdplug.plugin_api.storage",
    **dict.fromkeys(("ParserContext", "ReasoningDelta", "ReasoningParser", "ReasoningParserSpec", "ToolCallDelta",
                     "ToolDelta", "ToolParser", "ToolParserSpec"), "fdplug.plugin_api.parsers"),
    "EngineView": "fdplug.plugin_api.engine_config", "ModelTraits": "fdplug.plugin_api.engine_config",
    "SamplingParams": "fdplug.plugin_api.sampling_params",
    **dict.fromkeys(("CachedRequestData", "MMPlaceholder", "NewRequestData", "SchedulerOutput"),
                    "fdplug.plugin_api.scheduled_work"),
}

__all__ = ["API_VERSION", "hookimpl", *sorted(_EXPORTS)]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fdplug.plugin_api' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
