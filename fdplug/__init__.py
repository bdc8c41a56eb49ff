"""fdplug: an LLM inference server whose hardware support is a set of plugins.

    fdplug/plugin_api/  the contract: hooks, specs, protocols, settings (what a plugin imports)
    fdplug/core/        engine, scheduler, KV cache, runner, model, multimodal, plugin loading and
                        selection, and the portable components every device gets
    fdplug/server/      ``fdplug serve`` (the OpenAI-compatible API process and the engine process)
                        and ``fdplug router``
    fdplug/cli/         the ``fdplug`` command line
    fdplug/plugins/     the built-in plugins: cpu, cuda, xpu, blackwell_moe, storage_fs, storage_bos
    fdplug/demo/        the trained demo model and the generated test models
    fdplug/testing/     the conformance kit for plugin authors (a pytest plugin)

``import fdplug`` is light: it never imports paddle or a vendor SDK.
"""

from __future__ import annotations

from fdplug.core.plugin_loading.loader import list_plugins, load_plugins
from fdplug.core.plugin_loading.selection import select_components
from fdplug.plugin_api.hookspecs import API_VERSION, hookimpl
from fdplug.plugin_api.selection import Selection
from fdplug.version import __version__

__all__ = ["API_VERSION", "LLM", "SamplingParams", "Selection", "hookimpl", "list_plugins", "load_plugins",
           "select_components", "__version__"]


def __getattr__(name: str):
    """``fdplug.LLM`` and ``fdplug.SamplingParams`` without importing the engine at ``import fdplug``."""
    if name == "LLM":
        from fdplug.core.frontend.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fdplug.plugin_api.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'fdplug' has no attribute {name!r}")
