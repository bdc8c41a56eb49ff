"""fdplug: an LLM inference server whose hardware support is a set of plugins.

``import fdplug`` is light: it never imports paddle or a vendor SDK.
"""

from __future__ import annotations

from fdplug.core.hookspecs import API_VERSION, hookimpl
from fdplug.core.plugins import list_plugins, load_plugins
from fdplug.core.selection import Backend, select_backend

__version__ = "0.1.0"

__all__ = ["API_VERSION", "LLM", "Backend", "SamplingParams", "hookimpl", "list_plugins", "load_plugins",
           "select_backend", "__version__"]


def __getattr__(name: str):
    """``fdplug.LLM`` and ``fdplug.SamplingParams`` without importing the engine at ``import fdplug``."""
    if name == "LLM":
        from fdplug.core.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fdplug.core.request import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'fdplug' has no attribute {name!r}")
