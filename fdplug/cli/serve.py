"""``fdplug serve``: the OpenAI-compatible server (`fdplug.server.api.launcher`), its flags and their parsing."""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from fdplug.cli.http import http_front_options, http_front_settings
from fdplug.cli.options import engine_kwargs, engine_options
from fdplug.cli.user_errors import user_errors
from fdplug.server.http.limits import DEFAULT_STREAM_BACKLOG


@click.command("serve")
@engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: all).")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to listen on (0: any free port).")
@click.option("--api-key", default=None, help="Require `Authorization: Bearer KEY` on /v1 (or set FDPLUG_API_KEY).")
@click.option("--served-model-name", default=None, help="The model's name in the API (default: --model, or demo).")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=8 << 20, show_default=True,
              help="Largest request body; larger ones get 413.")
@click.option("--stream-interval", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tokens per streamed chunk after the first (fewer socket writes under load; 1: every step).")
@click.option("--max-waiting-requests", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Requests queued beyond the running batch; more get 503.")
@click.option("--trust-request-chat-template", is_flag=True,
              help="Run chat templates sent in requests (chat_template): a template is code; trusted clients only.")
@click.option("--data-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Engine processes, each with its own KV cache, behind this one API (cpu: the cores split "
                   "between them; other devices: device i for engine i). Requests go to the least loaded, "
                   "preferring one that has their prefix cached.")
@click.option("--data-parallel-backend", type=click.Choice(["mp", "ray"]), default="mp", show_default=True,
              help="mp: engine processes on this machine; ray: engines placed by Ray (across its machines), "
                   "restarted when they die.")
@click.option("--ray-address", default=None,
              help="With --data-parallel-backend ray: the cluster to join (ray start --head's address); "
                   "default: a local Ray.")
@click.option("--role", type=click.Choice(["prefill", "decode"]), default=None,
              help="Prefill/decode disaggregation: this instance prefills requests (max_tokens=1) and holds their KV "
                   "for a decode instance to pull, or decodes requests whose KV it pulls (kv_transfer_params).")
@click.option("--kv-connector", default=None,
              help="With --role: how KV moves between prefill and decode instances (default: by priority; "
                   "`fdplug explain --role decode` lists them).")
@click.option("--kv-port", type=click.IntRange(1, 65535), default=None,
              help="With --role prefill: the port decode instances pull KV from, on FDPLUG_KV_HOST (or FDPLUG_KV_PORT; "
                   "default: a free one, logged at startup). "
                       "Data-parallel engines take the first free ports from it on.")
@click.option("--kv-peers", multiple=True, metavar="HOST:PORT",
              help="With --role decode: the KV endpoint of a prefill instance it may pull from (repeatable or "
                   "comma-separated; HOST:FIRST-LAST for a range; or FDPLUG_KV_PEERS). "
                       "Needed without FDPLUG_PD_SECRET.")
@click.option("--expert-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="MoE models: shard the routed experts over this many engines (the data-parallel engines; "
                   "each keeps its own KV cache and requests) that run every forward pass together, tokens "
                   "exchanged through paddle.distributed (gloo on cpu).")
@click.option("--max-stream-backlog", type=click.IntRange(min=1), default=DEFAULT_STREAM_BACKLOG, show_default=True,
              help="Tokens (each logprob alternative one) a stream may hold for a client that stopped reading; past "
                   "it the request is aborted and the connection closed.")
@click.option("--reasoning-parser", default=None, metavar="NAME",
              help="Split a thinking model's answer into reasoning_content and content (qwen3, deepseek_r1, ernie, "
                   "glm45, or a plugin's; `fdplug plugins` lists them).")
@click.option("--tool-call-parser", default=None, metavar="NAME",
              help="The model's tool-call format (hermes, ernie, glm45, llama3_json, or a plugin's).")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help="Answer requests with tools (tool_choice auto): the model's calls come back as tool_calls "
                   "(needs --tool-call-parser).")
@http_front_options
@user_errors
def serve_command(host: str, port: int, api_key: str | None, served_model_name: str | None, max_body_bytes: int,
                  stream_interval: int, max_waiting_requests: int, trust_request_chat_template: bool,
                  data_parallel_size: int, data_parallel_backend: str, ray_address: str | None,
                  expert_parallel_size: int, role: str | None, kv_connector: str | None, **kw: Any) -> None:
    """Serve the OpenAI API (chat, completions, streaming) with the engine in its own process."""
    from fdplug.server.api.launcher import serve
    from fdplug.server.api.server_settings import ServerSettings

    logging.getLogger("fdplug").setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    front = http_front_settings(kw)
    max_stream_backlog = kw.pop("max_stream_backlog")
    parsing = {name: kw.pop(name) for name in ("reasoning_parser", "tool_call_parser", "enable_auto_tool_choice")}
    args = engine_kwargs(kw)
    args["max_waiting_requests"] = max_waiting_requests
    if role is not None:
        args["kv_role"] = role
    if kv_connector is not None:
        args["kv_connector"] = kv_connector
    kv_port, kv_peers = kw.pop("kv_port"), kw.pop("kv_peers")
    if kv_port is not None:
        args["kv_port"] = kv_port
    if kv_peers:
        args["kv_peers"] = kv_peers
    settings = ServerSettings(host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                              max_body_bytes=max_body_bytes, stream_interval=stream_interval,
                              trust_request_chat_template=trust_request_chat_template,
                              data_parallel_size=data_parallel_size, data_parallel_backend=data_parallel_backend,
                              ray_address=ray_address, expert_parallel_size=expert_parallel_size,
                              max_stream_backlog=max_stream_backlog, **parsing, **front)
    sys.exit(serve(settings, args))
