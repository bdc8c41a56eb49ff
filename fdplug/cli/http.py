"""The flags every HTTP front takes (`fdplug serve` and `fdplug router`): draining and per-client bounds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

import click

from fdplug.server.http.limits import ConnectionLimits
from fdplug.server.settings import DEFAULT_SHUTDOWN_TIMEOUT_S, env


def http_front_options(fn: Callable) -> Callable:
    """``--shutdown-timeout`` and the connection limits (`fdplug.server.http.connection_guard`)."""
    fn = connection_options(fn)
    return click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=None,
                        help="SIGTERM: seconds the requests in flight may take to finish while new ones and /health "
                             f"get 503; then the rest are aborted (default FDPLUG_SHUTDOWN_TIMEOUT, "
                             f"{DEFAULT_SHUTDOWN_TIMEOUT_S:g}; a second "
                             "signal stops at once).")(fn)


def http_front_settings(kw: dict[str, Any]) -> dict[str, Any]:
    """Pop the flags `http_front_options` added: ``shutdown_timeout`` and ``limits``."""
    timeout = kw.pop("shutdown_timeout")
    return {"shutdown_timeout": env("FDPLUG_SHUTDOWN_TIMEOUT") if timeout is None else timeout,
            "limits": limits_from(kw)}


LIMIT_HELP = {
    "max_header_bytes": "Largest request line + headers, in bytes; past it a 431.",
    "max_header_count": "Most header fields in one request; past it a 431.",
    "idle_timeout": "Seconds a connection with no request in progress stays open (0: off).",
    "request_timeout": "Seconds for a request's head and body to arrive from its first byte; then a 408 (0: off).",
    "write_timeout": "Seconds a client may read nothing of a pending response before it is dropped (0: off).",
}


def connection_options(fn: Callable) -> Callable:
    """The per-connection limit flags, defaults shown (``limits_from`` pops them back out)."""
    for field in reversed(fields(ConnectionLimits)):
        kind = click.IntRange(min=1) if field.type == "int" else click.FloatRange(min=0)
        fn = click.option("--" + field.name.replace("_", "-"), type=kind, default=field.default, show_default=True,
                          help=LIMIT_HELP[field.name])(fn)
    return fn


def limits_from(kw: dict[str, Any]) -> ConnectionLimits:
    """Pop the ``connection_options`` values out of a click kwargs dict."""
    return ConnectionLimits(**{field.name: kw.pop(field.name) for field in fields(ConnectionLimits)})
