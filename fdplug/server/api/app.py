"""The FastAPI app: routes, OpenAI error objects, and the guard in front of it (API key, body size).

Every error a client can cause is an ``FdplugError`` and leaves as ``{"error": {message, type,
param, code}}`` with the error's ``http_status``; pydantic problems are 400s (not FastAPI's 422);
anything else is a bug: logged with its traceback, answered with a 500 that reveals nothing.
The guard is plain ASGI (not ``BaseHTTPMiddleware``, which would buffer streaming responses).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import fdplug
from fdplug.errors import (
    AuthenticationError,
    FdplugError,
    InvalidRequestError,
    RequestTooLargeError,
)
from fdplug.server.api import openai_types as T
from fdplug.server.api.engine_client import EngineClient
from fdplug.server.api.jobs import JobBuilder, parse_job_request
from fdplug.server.api.metrics import CONTENT_TYPE_LATEST
from fdplug.server.api.pd_params import check_kv_transfer_params
from fdplug.server.api.request_stream import BacklogQueue
from fdplug.server.api.serving import Serving

if TYPE_CHECKING:
    from fdplug.server.api.launcher import ServerSettings
    from fdplug.server.http.drain import Drain

logger = logging.getLogger("fdplug.server")

OPEN_PATHS = ("/health", "/metrics", "/version")   # never need the API key: probes and scrapers


def error_response(exc: FdplugError, metrics: Any = None) -> JSONResponse:
    message = exc.message + (f" Fix: {exc.fix}" if exc.fix else "")
    code = getattr(exc, "code", None) or exc.http_status
    if metrics is not None:
        metrics.http_error(exc.http_status)
    return JSONResponse(T.error_body(message, exc.error_type, getattr(exc, "param", None), code),
                        status_code=exc.http_status)


def guarded(handler: Callable[[Request], Awaitable[Response]],
            metrics: Any) -> Callable[[Request], Awaitable[Response]]:
    """A route whose failures are OpenAI error objects: its ``FdplugError`` with its status, anything
    else a bug (logged with its traceback, a 500 that reveals nothing)."""
    async def wrapper(request: Request) -> Response:
        try:
            return await handler(request)
        except FdplugError as exc:
            return error_response(exc, metrics)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("bug while serving %s", request.url.path)
            metrics.http_error(500)
            return JSONResponse(T.error_body("internal server error (a bug; the server log has the details).",
                                             "server_error", None, 500), status_code=500)
    return wrapper


def answer_unknown_routes(app: Any, metrics: Any) -> None:
    """An unknown path (404) or a wrong method (405) answered as an OpenAI error object, not plain text."""
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        metrics.http_error(exc.status_code)
        return JSONResponse(T.error_body(f"{request.method} {request.url.path}: {exc.detail}.", kind, None,
                                         exc.status_code), status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(StarletteHTTPException, http_error)


def build_app(client: EngineClient, model_name: str, settings: ServerSettings, api_key: str | None,
              kv_role: str | None, drain: Drain) -> Any:
    """The ASGI app uvicorn runs: the guard around the FastAPI routes."""
    app = FastAPI(title="fdplug", version=fdplug.__version__, docs_url=None, redoc_url=None, openapi_url=None)
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
        return JSONResponse(T.error_body(error.message, "server_error", None, 503), status_code=503)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": fdplug.__version__, "api_version": fdplug.API_VERSION})

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


class Guard:
    """Before the app runs: the drain's door (`Drain`), the API key (constant-time compare) on
    ``/v1/*``, then the body size limit. Probes (``/health``, ``/metrics``, ``/version``) pass.

    The limit is checked on ``Content-Length`` and again while the body is read (chunked uploads
    have none); an accepted body is handed to the app as one message. Every request let in counts
    as in flight until the app has answered it to the end, and one that uvicorn cancels before its
    answer started (its shutdown grace ended) still gets a JSON 503.
    """

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int, metrics: Any, drain: Drain) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.drain = drain

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"].startswith(OPEN_PATHS):
            return await self.app(scope, receive, send)
        if self.drain.draining:
            return await self._reject(send, self.drain.refusal())
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        self.drain.active += 1
        try:
            await self._guard(scope, receive, tracked)
        except asyncio.CancelledError:
            if started or not self.drain.draining:
                raise
            await self._reject(send, self.drain.refusal())
        finally:
            self.drain.active -= 1

    async def _guard(self, scope: dict, receive: Callable, send: Callable) -> None:
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and not self._authorized(headers):
            return await self._reject(send, AuthenticationError(
                "missing or incorrect API key.", fix="send it as the header `Authorization: Bearer <key>`."),
                code="invalid_api_key", extra_headers=[(b"www-authenticate", b"Bearer")])
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_large = RequestTooLargeError(f"the request body is over this server's limit of {self.max_body_bytes} "
                                         "bytes.", fix="send a smaller request, or start the server with a larger "
                                                       "--max-body-bytes.")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await self._reject(send, too_large)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                return await self._reject(send, too_large)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _authorized(self, headers: dict) -> bool:
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def _reject(self, send: Callable, exc: FdplugError, code: str | None = None,
                      extra_headers: list | None = None) -> None:
        self.metrics.http_error(exc.http_status)
        message = exc.message + (f" Fix: {exc.fix}" if exc.fix else "")
        body = json.dumps(T.error_body(message, exc.error_type, None, code or exc.http_status)).encode()
        await send({"type": "http.response.start", "status": exc.http_status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"), *(extra_headers or [])]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
