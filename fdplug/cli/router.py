"""``fdplug router``: the OpenAI-compatible front over prefill and decode instances (`fdplug.server.router`)."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

import click

from fdplug.cli.http import http_front_options, http_front_settings
from fdplug.cli.user_errors import user_errors

if TYPE_CHECKING:
    from fdplug.server.http.limits import ConnectionLimits


@click.command("router")
@click.option("--prefill", "prefill", multiple=True, required=True, metavar="URL",
              help="A prefill instance (fdplug serve --role prefill), e.g. http://10.0.0.1:8001; repeat for more.")
@click.option("--decode", "decode", multiple=True, required=True, metavar="URL",
              help="A decode instance (fdplug serve --role decode); repeat for more.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: all).")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to listen on.")
@click.option("--api-key", default=None, help="Require `Authorization: Bearer KEY` on /v1 (or set FDPLUG_API_KEY); "
                                              "the header goes on to the instances.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=8 << 20, show_default=True,
              help="Largest request body; larger ones get 413.")
@http_front_options
@user_errors
def router_command(prefill: tuple[str, ...], decode: tuple[str, ...], host: str, port: int, api_key: str | None,
                   max_body_bytes: int, **kw: Any) -> None:
    """An OpenAI-compatible front over prefill and decode instances (PD disaggregation)."""
    logging.getLogger("fdplug").setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    sys.exit(run_router(list(prefill), list(decode), host, port, api_key, max_body_bytes, **http_front_settings(kw)))


def run_router(prefill: list[str], decode: list[str], host: str, port: int, api_key: str | None,
               max_body_bytes: int, shutdown_timeout: float, limits: ConnectionLimits) -> int:
    """Serve until a signal (drained: `fdplug.server.http.drain`); the exit status."""
    import asyncio

    from fdplug.server.http.drain import DrainingServer
    from fdplug.server.http.guard import Guard
    from fdplug.server.router.pd_router import PDRouter, logger
    from fdplug.server.settings import env

    async def run() -> None:
        router = PDRouter(prefill, decode, env("FDPLUG_ROUTER_PREFILL_TIMEOUT"), env("FDPLUG_ENGINE_STALL_TIMEOUT"),
                          shutdown_timeout, env("FDPLUG_ROUTER_MAX_CONNECTIONS"))
        key = api_key if api_key is not None else env("FDPLUG_API_KEY")
        app = Guard(router.app, key, max_body_bytes, router.metrics, router.drain)
        logger.info("fdplug router on http://%s:%d: prefill %s, decode %s", host, port, ", ".join(prefill),
                    ", ".join(decode))
        try:
            await DrainingServer(app, router.drain, asyncio.get_running_loop(), limits, host=host, port=port).serve()
        finally:
            await router.http.aclose()

    asyncio.run(run())      # a signal is a normal stop: status 0
    return 0
