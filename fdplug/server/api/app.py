"""The FastAPI app: its routes, behind the guard (`fdplug.server.http.guard`: API key, body size).

Every error a client can cause is an ``FdplugError`` and leaves as ``{"error": {message, type,
param, code}}`` with the error's ``http_status`` (`fdplug.server.http.error_responses`); pydantic
problems are 400s (not FastAPI's 422); anything else is a bug: logged with its traceback, answered
with a 500 that reveals nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fdplug.errors import InvalidRequestError
from fdplug.plugin_api.hookspecs import API_VERSION
from fdplug.server.api import openai_types as T
from fdplug.server.api.engine_client import EngineClient
from fdplug.server.api.jobs import JobBuilder, parse_job_request
from fdplug.server.api.metrics import CONTENT_TYPE_LATEST
from fdplug.server.api.pd_params import check_kv_transfer_params
from fdplug.server.api.request_stream import BacklogQueue
from fdplug.server.api.serving import Serving
from fdplug.server.http.error_responses import answer_unknown_routes, error_body, guarded
from fdplug.server.http.guard import Guard
from fdplug.version import __version__

if TYPE_CHECKING:
    from fdplug.server.api.server_settings import ServerSettings
    from fdplug.server.http.drain import Drain


def build_app(client: EngineClient, model_name: str, settings: ServerSettings, api_key: str | None,
              kv_role: str | None, drain: Drain) -> Any:
    """The ASGI app uvicorn runs: the guard around the FastAPI routes."""
    app = FastAPI(title="fdplug", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    jobs = JobBuilder(client, model_name, settings.trust_request_chat_template)
    serving = Serving(client, settings.stream_interval)
    metrics = client.metrics
    started = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        """200 while an engine serves ("degraded" when a data-parallel engine died), with each
        engine's rank, pid, state and requests in flight; 503 once none does."""
        if client.healthy and not drain.draining:
            engines = client.engines()
            return JSONResponse({"status": "ok" if all(e["alive"] for e in engines) else "degraded",
                                 "engines": engines})
        error = client.error if not client.healthy else drain.refusal()
        return JSONResponse(error_body(error.message, "server_error", None, 503), status_code=503)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__, "api_version": API_VERSION})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        card = T.model_card(model_name, started, client.info.model_dir, client.info.max_model_len)
        return JSONResponse({"object": "list", "data": [card]})

    # Parsing, the chat template and tokenizing run in a worker thread: a large body or a long
    # conversation costs its sender time, not every stream on the event loop (/health included).
    # Nothing is registered with the engine there, so a failure leaves nothing behind.

    def completion_job(body: bytes) -> tuple:
        req, params = parse_job_request("/v1/completions", body)
        return req, *jobs.completion_job(req, params)

    def chat_job(body: bytes, tenant_id: str) -> tuple:
        req, params = parse_job_request("/v1/chat/completions", body)
        return req, *jobs.chat_job(req, params, tenant_id)

    @app.post("/v1/completions")
    @partial(guarded, metrics=metrics)
    async def completions(request: Request) -> Response:
        req, job, prepared, params = await asyncio.to_thread(completion_job, await request.body())
        return await _run(job, prepared, params, req, request)

    @app.post("/v1/chat/completions")
    @partial(guarded, metrics=metrics)
    async def chat_completions(request: Request) -> Response:
        req, job, prepared, params = await asyncio.to_thread(chat_job, await request.body(), tenant(request))
        return await _run(job, prepared, params, req, request)

    def data_parallel_rank(request: Request) -> int | None:
        """vLLM's ``X-Data-Parallel-Rank`` header: the engine a request must go to (None: the router's choice)."""
        raw = request.headers.get("x-data-parallel-rank")
        if raw is None:
            return None
        raw = raw.strip()
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 6):    # "²".isdigit() is true; int() refuses it
            raise InvalidRequestError(f"X-Data-Parallel-Rank must be an engine's rank (0, 1, ...), got {raw[:20]!r}.",
                                      fix="send a non-negative integer, or leave the header out.",
                                      param="X-Data-Parallel-Rank")
        return int(raw)

    def tenant(request: Request) -> str:
        """Whose multimodal uuids these are: a digest of the presented API key (no key: one tenant)."""
        token = request.headers.get("authorization", "").partition(" ")[2].strip()
        return hashlib.sha256(token.encode()).hexdigest()[:32] if token else ""

    async def _run(job: Any, prepared: list, params: Any, req: Any, request: Request) -> Response:
        rank = data_parallel_rank(request)
        kv_params = check_kv_transfer_params(req.kv_transfer_params, kv_role, params.n, client.info.vocab_size,
                                             num_prompts=len(prepared))
        for prompt in prepared:
            prompt.kv_transfer_params = kv_params
        if not req.stream:
            serving.submit(job, prepared, params, None, req.cache_salt, rank)
            return await serving.respond(job, request)
        connection = request.scope.get("extensions", {}).get("fdplug.connection")   # `connection_guard`
        queue = BacklogQueue(settings.max_stream_backlog, lambda: asyncio.get_running_loop().call_soon(
            serving.cut_off, job, connection, settings.max_stream_backlog),
            lambda: connection is None or connection.write_paused)
        serving.submit(job, prepared, params, queue, req.cache_salt, rank)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await serving.stream(job, queue, include_usage, request)

    answer_unknown_routes(app, metrics)

    return Guard(app, api_key, settings.max_body_bytes, metrics, drain)
