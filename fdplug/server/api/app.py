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
    routes = Routes(client, model_name, settings, kv_role, drain)
    metrics = routes.metrics
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/version", routes.version, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics_route, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", guarded(routes.model, metrics), methods=["GET"])
    app.add_api_route("/v1/completions", guarded(routes.completions, metrics), methods=["POST"])
    app.add_api_route("/v1/chat/completions", guarded(routes.chat_completions, metrics), methods=["POST"])
    app.add_api_route("/tokenize", guarded(routes.tokenize, metrics), methods=["POST"])
    app.add_api_route("/detokenize", guarded(routes.detokenize, metrics), methods=["POST"])
    answer_unknown_routes(app, metrics)
    return Guard(app, api_key, settings.max_body_bytes, metrics, drain)


class Routes:
    """The API's routes, one method each, over one engine client (or the data-parallel one)."""

    def __init__(self, client: EngineClient, model_name: str, settings: ServerSettings, kv_role: str | None,
                 drain: Drain) -> None:
        self.client = client
        self.model_name = model_name
        self.settings = settings
        self.kv_role = kv_role
        self.drain = drain
        self.metrics = client.metrics
        self.jobs = JobBuilder(client, model_name, settings.trust_request_chat_template, settings.parsers,
                               settings.enable_auto_tool_choice)
        self.serving = Serving(client, settings.stream_interval)
        self.started = int(time.time())

    async def health(self) -> Response:
        """200 while an engine serves ("degraded" when a data-parallel engine died), with each
        engine's rank, pid, state and requests in flight; 503 once none does."""
        client, drain = self.client, self.drain
        if client.healthy and not drain.draining:
            engines = client.engines()
            return JSONResponse({"status": "ok" if all(e["alive"] for e in engines) else "degraded",
                                 "engines": engines})
        error = client.error if not client.healthy else drain.refusal()
        return JSONResponse(error_body(error.message, "server_error", None, 503), status_code=503)

    async def version(self) -> Response:
        return JSONResponse({"version": __version__, "api_version": API_VERSION})

    async def metrics_route(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        """OpenAI's ``GET /v1/models/{model}``: the served model's card, or a 404 naming the one asked for."""
        self.jobs.check_model(request.path_params["model_id"])
        return JSONResponse(self._card())

    def _card(self) -> dict:
        info = self.client.info
        return T.model_card(self.model_name, self.started, info.model_dir, info.max_model_len)

    # Parsing, the chat template and tokenizing run in a worker thread: a large body or a long
    # conversation costs its sender time, not every stream on the event loop (/health included).
    # Nothing is registered with the engine there, so a failure leaves nothing behind.

    async def completions(self, request: Request) -> Response:
        req, job, prepared, params = await asyncio.to_thread(self._completion_job, await request.body())
        return await self._run(job, prepared, params, req, request)

    async def chat_completions(self, request: Request) -> Response:
        req, job, prepared, params = await asyncio.to_thread(self._chat_job, await request.body(), tenant(request))
        return await self._run(job, prepared, params, req, request)

    async def tokenize(self, request: Request) -> Response:
        return JSONResponse(await asyncio.to_thread(self.jobs.tokenize, await request.body(), tenant(request)))

    async def detokenize(self, request: Request) -> Response:
        return JSONResponse(await asyncio.to_thread(self.jobs.detokenize, await request.body()))

    def _completion_job(self, body: bytes) -> tuple:
        req, params = parse_job_request("/v1/completions", body)
        return req, *self.jobs.completion_job(req, params)

    def _chat_job(self, body: bytes, tenant_id: str) -> tuple:
        req, params = parse_job_request("/v1/chat/completions", body)
        return req, *self.jobs.chat_job(req, params, tenant_id)

    async def _run(self, job: Any, prepared: list, params: Any, req: Any, request: Request) -> Response:
        rank = data_parallel_rank(request)
        kv_params = check_kv_transfer_params(req.kv_transfer_params, self.kv_role, params.n,
                                             self.client.info.vocab_size, num_prompts=len(prepared))
        for prompt in prepared:
            prompt.kv_transfer_params = kv_params
        serving, backlog = self.serving, self.settings.max_stream_backlog
        if not req.stream:
            serving.submit(job, prepared, params, None, req.cache_salt, rank)
            return await serving.respond(job, request)
        connection = request.scope.get("extensions", {}).get("fdplug.connection")   # `connection_guard`
        queue = BacklogQueue(backlog, lambda: asyncio.get_running_loop().call_soon(
            serving.cut_off, job, connection, backlog),
            lambda: connection is None or connection.write_paused)
        serving.submit(job, prepared, params, queue, req.cache_salt, rank)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        job.usage_every_chunk = include_usage and req.stream_options.continuous_usage_stats
        return await serving.stream(job, queue, include_usage, request)


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
