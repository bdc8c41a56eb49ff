"""``fdplug router``: the OpenAI-compatible front over prefill and decode instances (`server.pd_router`)."""

from __future__ import annotations

import logging
import sys

import click

from fdplug.cli import user_errors


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
@user_errors
def router_command(prefill: tuple[str, ...], decode: tuple[str, ...], host: str, port: int, api_key: str | None,
                   max_body_bytes: int) -> None:
    """An OpenAI-compatible front over prefill and decode instances (PD disaggregation)."""
    from fdplug.server.pd_router import run_router

    logging.getLogger("fdplug").setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    sys.exit(run_router(list(prefill), list(decode), host, port, api_key, max_body_bytes))
