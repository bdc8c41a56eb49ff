"""The flags every HTTP front takes (`fdplug serve` and `fdplug router`): draining and per-client bounds."""

from __future__ import annotations

from typing import Any, Callable

import click

from fdplug.server.connection_guard import connection_options, limits_from
from fdplug.server.settings import env


def http_front_options(fn: Callable) -> Callable:
    """``--shutdown-timeout`` and the connection limits (`fdplug.server.connection_guard`)."""
    fn = connection_options(fn)
    return click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=None,
                        help="SIGTERM: seconds the requests in flight may take to finish while new ones and /health "
                             "get 503; then the rest are aborted (default FDPLUG_SHUTDOWN_TIMEOUT, 25; a second "
                             "signal stops at once).")(fn)


def http_front_settings(kw: dict[str, Any]) -> dict[str, Any]:
    """Pop the flags `http_front_options` added: ``shutdown_timeout`` and ``limits``."""
    timeout = kw.pop("shutdown_timeout")
    return {"shutdown_timeout": env("FDPLUG_SHUTDOWN_TIMEOUT") if timeout is None else timeout,
            "limits": limits_from(kw)}
