"""``fdplug router --prefill URL... --decode URL...``: one OpenAI-compatible front over PD instances.

Each completion or chat request goes to the least busy prefill instance (``fdplug serve --role
prefill``) as itself with ``max_tokens=1``, ``stream=false`` and ``kv_transfer_params={"do_remote_decode":
true}``; the answer's ``kv_transfer_params`` say where its prompt's KV waits and what its first token
was. Then the original request, with those params, goes to the least busy decode instance, whose
answer (one JSON body, or the SSE stream) is the client's, byte for byte. vLLM's proxy flow: decode
allocates only once prefill has succeeded, so nothing is reserved on a side that may never be used.

The router checks a body with the server's own parser and checks (`jobs.parse_job_request`), so
what an instance would refuse is refused here with the same 400, and nothing malformed is relayed;
its own failures, unknown paths and wrong methods are OpenAI error objects too. An instance's error
answer reaches the client unchanged; an instance that cannot be reached is a 503 naming it. Waits
are bounded: connect 5 s, a prefill answer ``FDPLUG_ROUTER_PREFILL_TIMEOUT``, a decode stream's
silence ``FDPLUG_ENGINE_STALL_TIMEOUT``. A client that leaves, streamed or not, at any stage, closes
the upstream request (the instance aborts it and frees its blocks). SIGTERM drains (`drain`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fdplug.errors import FdplugError, InvalidRequestError, ServerShuttingDownError
from fdplug.plugin_api.hookspecs import API_VERSION
from fdplug.server.api.jobs import parse_job_request
from fdplug.server.api.serving import sse_error, wait_disconnect
from fdplug.server.http.closing_stream import ClosingStream
from fdplug.server.http.drain import Drain
from fdplug.server.http.error_responses import answer_unknown_routes, error_response, guarded
from fdplug.server.router.metrics import RouterMetrics
from fdplug.server.settings import DEFAULT_SHUTDOWN_TIMEOUT_S
from fdplug.version import __version__

logger = logging.getLogger("fdplug.router")

CONNECT_TIMEOUT_S = 5.0
FORWARDED = ("authorization", "x-request-id")


class UpstreamError(FdplugError):
    """A prefill or decode instance could not be reached."""

    http_status = 503
    error_type = "server_error"


class BadUpstreamError(UpstreamError):
    """An instance answered, but not as a prefill instance does (no kv_transfer_params)."""

    http_status = 502


@dataclass(slots=True)
class Upstream:
    url: str
    in_flight: int = 0


class PDRouter:
    """The two pools and the request flow; `app` is the ASGI app uvicorn runs."""

    def __init__(self, prefill: list[str], decode: list[str], prefill_timeout: float, stall_timeout: float,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S, max_connections: int = 4096) -> None:
        if not prefill or not decode:
            raise ValueError("a router needs at least one prefill and one decode instance")
        self.prefill = [Upstream(url.rstrip("/")) for url in prefill]
        self.decode = [Upstream(url.rstrip("/")) for url in decode]
        self.prefill_timeout = httpx.Timeout(prefill_timeout, connect=CONNECT_TIMEOUT_S, pool=CONNECT_TIMEOUT_S)
        self.decode_timeout = httpx.Timeout(stall_timeout, connect=CONNECT_TIMEOUT_S, pool=CONNECT_TIMEOUT_S)
        # one connection per relay in flight (a stream holds its own): bounded, and a full pool is a 503 at once
        self.http = httpx.AsyncClient(limits=httpx.Limits(max_connections=max_connections,
                                                          max_keepalive_connections=min(max_connections, 256)))
        self.drain = Drain(shutdown_timeout, self._abort_all)   # its `Guard` (cli.router) counts what is in flight
        self.metrics = RouterMetrics(lambda: self.drain.active, (("prefill", self.prefill), ("decode", self.decode)))
        self.waiting: set[asyncio.Task] = set()        # relays not answering yet (prefill, decode's start)
        relay = guarded(self.relay, self.metrics)
        self.app = Starlette(routes=[Route("/v1/completions", relay, methods=["POST"]),
                                     Route("/v1/chat/completions", relay, methods=["POST"]),
                                     Route("/v1/models", self.models, methods=["GET"]),
                                     Route("/v1/models/{model_id:path}", self.models, methods=["GET"]),
                                     Route("/health", self.health, methods=["GET"]),
                                     Route("/version", self.version, methods=["GET"]),
                                     Route("/metrics", self.metrics.route, methods=["GET"])])
        answer_unknown_routes(self.app, self.metrics)

    # -- the flow ---------------------------------------------------------------------------------

    async def relay(self, request: Request) -> Response:
        """Check the body as an instance would, then prefill and decode, watching for the client
        leaving: a client gone before its answer starts closes the upstream request (the instance
        holding it aborts it and frees its blocks), streamed or not."""
        path = request.url.path
        try:
            body = await asyncio.to_thread(_request_body, path, await request.body())
        except FdplugError as exc:
            self.metrics.requests.labels("router", str(exc.http_status)).inc()
            raise
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        flow = asyncio.ensure_future(self._flow(path, body, headers))
        disconnect = asyncio.ensure_future(wait_disconnect(request))
        self.waiting.add(flow)
        try:
            done, _ = await asyncio.wait({flow, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if flow not in done:             # the client left: closing the upstream request aborts it there
                flow.cancel()
                await asyncio.wait({flow})
                return Response(status_code=499)        # nobody reads it
            if flow.cancelled():             # the drain's timeout ended it
                raise self._stopping()
            return flow.result()
        finally:
            disconnect.cancel()
            self.waiting.discard(flow)
            if not flow.done():
                flow.cancel()

    async def _flow(self, path: str, body: dict, headers: dict) -> Response:
        first = await self._prefill(path, body, headers)
        if isinstance(first, Response):
            self.metrics.requests.labels("prefill", str(first.status_code)).inc()
            return first
        body["kv_transfer_params"] = first
        reply = await self._decode(path, body, headers)
        self.metrics.requests.labels("decode", str(reply.status_code)).inc()
        return reply

    async def _prefill(self, path: str, body: dict, headers: dict) -> dict | Response:
        """The prefill instance's ``kv_transfer_params``, or the response to give the client."""
        prefill_body = {k: v for k, v in body.items() if k not in ("max_completion_tokens", "stream_options")}
        prefill_body.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True},
                            min_tokens=min(body.get("min_tokens", 0), 1))
        upstream = min(self.prefill, key=lambda u: u.in_flight)
        upstream.in_flight += 1
        try:
            reply = await self.http.post(upstream.url + path, content=_json(prefill_body), headers=headers,
                                         timeout=self.prefill_timeout)
        except httpx.HTTPError as exc:
            return error_response(UpstreamError(
                f"prefill instance {upstream.url} did not answer ({type(exc).__name__}).",
                fix="check that it runs (fdplug serve --role prefill) and is reachable."))
        finally:
            upstream.in_flight -= 1
        if reply.status_code != 200:
            return Response(reply.content, reply.status_code, media_type="application/json")
        try:
            params = reply.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict):
            return error_response(BadUpstreamError(f"{upstream.url} answered without kv_transfer_params.",
                                                   fix="start it with `fdplug serve --role prefill`."))
        return params

    async def _decode(self, path: str, body: dict, headers: dict) -> Response:
        upstream: Upstream | None = min(self.decode, key=lambda u: u.in_flight)
        upstream.in_flight += 1
        reply = None
        try:
            try:
                reply = await self.http.send(self.http.build_request("POST", upstream.url + path, content=_json(body),
                                                                     headers=headers, timeout=self.decode_timeout),
                                             stream=True)
                if reply.status_code == 200 and body.get("stream"):
                    stream = ClosingStream(self._chunks(reply, upstream), self._stream_closer(reply, upstream),
                                           media_type=reply.headers.get("content-type", "text/event-stream"))
                    reply = upstream = None     # the stream's now: it closes them however it ends
                    return stream
                content = await reply.aread()
            except httpx.HTTPError as exc:
                return error_response(UpstreamError(f"decode instance {upstream.url} did not answer "
                                                    f"({type(exc).__name__}).", fix="check that it runs (fdplug "
                                                    "serve --role decode) and is reachable."))
            return Response(content, reply.status_code, media_type=reply.headers.get("content-type"))
        finally:       # answered, failed, or cancelled (the client left): closing the reply aborts it upstream
            if reply is not None:
                await reply.aclose()
            if upstream is not None:
                upstream.in_flight -= 1

    async def _chunks(self, reply: httpx.Response, upstream: Upstream) -> AsyncIterator[bytes]:
        """The decode instance's SSE stream, byte for byte; an error event if it breaks, or if the
        drain's timeout ends it (even while the stream is silent: each chunk races the abort)."""
        chunks = reply.aiter_raw()
        aborting = asyncio.ensure_future(self.drain.aborting.wait())
        try:
            while True:
                step = asyncio.ensure_future(anext(chunks))
                await asyncio.wait({step, aborting}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    await asyncio.wait({step})
                    raise self._stopping()
                try:
                    chunk = step.result()
                except StopAsyncIteration:
                    return
                yield chunk
        except (httpx.HTTPError, ServerShuttingDownError) as exc:   # went silent or away, or we stop: say so
            logger.warning("decode stream from %s ended early: %s", upstream.url, type(exc).__name__)
            error = exc if isinstance(exc, FdplugError) else UpstreamError(
                f"the decode instance's stream broke ({type(exc).__name__}).", fix="retry the request.")
            yield sse_error(error)
            yield b"data: [DONE]\n\n"
        finally:
            aborting.cancel()

    def _stream_closer(self, reply: httpx.Response, upstream: Upstream) -> Callable[[], Awaitable[None]]:
        """Run once when the client's stream ends, even if its body never started (the client left)."""
        async def close() -> None:
            upstream.in_flight -= 1
            await reply.aclose()
        return close

    # -- stopping ---------------------------------------------------------------------------------

    def _stopping(self) -> ServerShuttingDownError:
        return ServerShuttingDownError("the router is shutting down; the request was aborted.",
                                       fix="retry against a running router.")

    def _abort_all(self) -> None:
        """The drain's timeout: requests not answering yet end with a 503, streams with an error event."""
        for flow in list(self.waiting):
            flow.cancel()

    # -- the rest ---------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        """``/v1/models`` and ``/v1/models/{model}``: a decode instance's answer (its 404 included)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        path = request.scope.get("raw_path", b"").decode("latin-1") or request.url.path   # (as the client encoded it)
        try:
            reply = await self.http.get(self.decode[0].url + path, headers=headers,
                                        timeout=httpx.Timeout(10.0, connect=CONNECT_TIMEOUT_S))
        except httpx.HTTPError:
            return error_response(UpstreamError(f"decode instance {self.decode[0].url} did not answer.",
                                                fix="check it runs."))
        return Response(reply.content, reply.status_code, media_type="application/json")

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__, "api_version": API_VERSION})

    async def health(self, request: Request) -> Response:
        """Each instance's /health (1 s each); 200 while a prefill and a decode instance answer and the
        router is not draining (SIGTERM: a 503 takes it out of a load balancer's rotation)."""
        if self.drain.draining:
            return error_response(self.drain.refusal(), self.metrics)
        status = {}
        for role, pool in (("prefill", self.prefill), ("decode", self.decode)):
            for upstream in pool:
                try:
                    ok = (await self.http.get(upstream.url + "/health", timeout=1.0)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                status.setdefault(role, []).append({"url": upstream.url, "alive": ok, "in_flight": upstream.in_flight})
        up = all(any(u["alive"] for u in status[role]) for role in ("prefill", "decode"))
        return JSONResponse({"status": "ok" if up else "unavailable", **status}, status_code=200 if up else 503)


def _request_body(path: str, raw: bytes) -> dict:
    """The client's body, checked as an instance checks it (`parse_job_request`: one contract), less
    what the router must set itself; as the JSON object to forward."""
    req, _ = parse_job_request(path, raw)
    if req.kv_transfer_params is not None:
        raise InvalidRequestError("unrecognized request argument supplied: kv_transfer_params.",
                                  fix="remove it: the router sets it.", param="kv_transfer_params")
    if req.n != 1:
        raise InvalidRequestError("the PD router serves one sequence a request (n=1).", fix="send n=1.", param="n")
    body = req.model_dump(exclude_unset=True)
    _json(body)          # a NaN or Infinity in a free-form field (messages, metadata...) is the client's error
    return body


def _json(body: dict) -> bytes:
    try:
        return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    except ValueError:
        raise InvalidRequestError("the body holds a number that is not finite (NaN or Infinity).",
                                  fix="send finite numbers only (JSON has no NaN).") from None
