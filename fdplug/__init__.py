"""fdplug: an LLM inference server whose hardware support is a set of plugins.

``import fdplug`` is light: it never imports paddle or a vendor SDK.
"""

from __future__ import annotations

from fdplug.core.hookspecs import API_VERSION, hookimpl
from fdplug.core.plugins import list_plugins, load_plugins
from fdplug.core.selection import Backend, select_backend

__version__ = "0.1.0"

__all__ = ["API_VERSION", "Backend", "hookimpl", "list_plugins", "load_plugins", "select_backend", "__version__"]
