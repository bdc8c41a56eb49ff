"""``fdplug router --prefill URL... --decode URL...``: one OpenAI-compatible front over PD instances.

Each completion or chat request goes to the least busy prefill instance (``fdplug serve --role
prefill``) as itself with ``max_tokens=1``, ``stream=false`` and ``kv_transfer_params={"do_remote_decode":
true}``; the answer's ``kv_transfer_params`` say where its prompt's KV waits and what its first token
was. Then the original request, with those params, goes to the least busy decode instance, whose
answer (one JSON body, or the SSE stream) is the client's, byte for byte. vLLM's proxy flow: decode
allocates only once prefill has succeeded, so nothing is reserved on a side that may never be used.

An instance's error answer reaches the client unchanged (the same OpenAI error objects as
``fdplug serve``); an instance that cannot be reached is a 503 naming it. Waits are bounded: connect
5 s, a prefill answer ``FDPLUG_ROUTER_PREFILL_TIMEOUT``, a decode stream's silence
``FDPLUG_ENGINE_STALL_TIMEOUT``. A client that leaves closes the upstream stream (the decode instance
aborts the request and frees its blocks).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fdplug.errors import FdplugError, InvalidRequestError
from fdplug.server import openai_types as T
from fdplug.server.app import error_response

logger = logging.getLogger("fdplug.router")

CONNECT_TIMEOUT_S = 5.0
FORWARDED = ("authorization", "x-request-id")


class UpstreamError(FdplugError):
    """A prefill or decode instance could not be reached, or did not answer as one."""

    http_status = 503
    error_type = "server_error"


@dataclass(slots=True)
class Upstream:
    url: str
    in_flight: int = 0


class PDRouter:
    """The two pools and the request flow; `app` is the ASGI app uvicorn runs."""

    def __init__(self, prefill: list[str], decode: list[str], prefill_timeout: float, stall_timeout: float) -> None:
        if not prefill or not decode:
            raise ValueError("a router needs at least one prefill and one decode instance")
        self.prefill = [Upstream(url.rstrip("/")) for url in prefill]
        self.decode = [Upstream(url.rstrip("/")) for url in decode]
        self.prefill_timeout = httpx.Timeout(prefill_timeout, connect=CONNECT_TIMEOUT_S)
        self.decode_timeout = httpx.Timeout(stall_timeout, connect=CONNECT_TIMEOUT_S)
        self.http = httpx.AsyncClient()
        self.metrics = RouterMetrics(self)
        self.app = Starlette(routes=[Route("/v1/completions", self.relay, methods=["POST"]),
                                     Route("/v1/chat/completions", self.relay, methods=["POST"]),
                                     Route("/v1/models", self.models, methods=["GET"]),
                                     Route("/health", self.health, methods=["GET"]),
                                     Route("/version", self.version, methods=["GET"]),
                                     Route("/metrics", self.metrics.route, methods=["GET"])])

    # -- the flow ---------------------------------------------------------------------------------

    async def relay(self, request: Request) -> Response:
        try:
            body = _request_body(await request.body())
        except FdplugError as exc:
            self.metrics.requests.labels("router", str(exc.http_status)).inc()
            return error_response(exc)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        path = request.url.path
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
                            min_tokens=min(int(body.get("min_tokens") or 0), 1))
        upstream = min(self.prefill, key=lambda u: u.in_flight)
        upstream.in_flight += 1
        try:
            reply = await self.http.post(upstream.url + path, json=prefill_body, headers=headers,
                                         timeout=self.prefill_timeout)
        except httpx.HTTPError as exc:
            return error_response(UpstreamError(f"prefill instance {upstream.url} did not answer ({type(exc).__name__}).",
                                        fix="check that it runs (fdplug serve --role prefill) and is reachable."))
        finally:
            upstream.in_flight -= 1
        if reply.status_code != 200:
            return Response(reply.content, reply.status_code, media_type="application/json")
        params = reply.json().get("kv_transfer_params")
        if not isinstance(params, dict):
            return error_response(UpstreamError(f"{upstream.url} answered without kv_transfer_params.",
                                        fix="start it with `fdplug serve --role prefill`."))
        return params

    async def _decode(self, path: str, body: dict, headers: dict) -> Response:
        upstream = min(self.decode, key=lambda u: u.in_flight)
        upstream.in_flight += 1
        try:
            reply = await self.http.send(self.http.build_request("POST", upstream.url + path, json=body,
                                                                 headers=headers, timeout=self.decode_timeout),
                                         stream=True)
        except httpx.HTTPError as exc:
            upstream.in_flight -= 1
            return error_response(UpstreamError(f"decode instance {upstream.url} did not answer ({type(exc).__name__}).",
                                        fix="check that it runs (fdplug serve --role decode) and is reachable."))
        if reply.status_code != 200 or not body.get("stream"):
            try:
                content = await reply.aread()
            finally:
                await reply.aclose()
                upstream.in_flight -= 1
            return Response(content, reply.status_code, media_type=reply.headers.get("content-type"))

        async def chunks():
            try:
                async for chunk in reply.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:   # the decode instance went silent or away: say so in the stream
                logger.warning("decode stream from %s broke: %s", upstream.url, type(exc).__name__)
                error = UpstreamError(f"the decode instance's stream broke ({type(exc).__name__}).",
                                      fix="retry the request.")
                yield f"data: {json.dumps(T.error_body(error.message, error.error_type, None, 503))}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                await reply.aclose()
                upstream.in_flight -= 1

        return StreamingResponse(chunks(), media_type=reply.headers.get("content-type", "text/event-stream"))

    # -- the rest ---------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        try:
            reply = await self.http.get(self.decode[0].url + "/v1/models", headers=headers,
                                        timeout=httpx.Timeout(10.0, connect=CONNECT_TIMEOUT_S))
        except httpx.HTTPError:
            return error_response(UpstreamError(f"decode instance {self.decode[0].url} did not answer.", fix="check it runs."))
        return Response(reply.content, reply.status_code, media_type="application/json")

    async def version(self, request: Request) -> Response:
        import fdplug

        return JSONResponse({"version": fdplug.__version__, "api_version": fdplug.API_VERSION})

    async def health(self, request: Request) -> Response:
        """Each instance's /health (1 s each); 200 while a prefill and a decode instance answer."""
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


def _request_body(raw: bytes) -> dict:
    """The client's JSON object, refusing what the router must set itself."""
    try:
        body = json.loads(raw)
    except ValueError:
        raise InvalidRequestError("the request body is not valid JSON.", fix="send a JSON object.") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object.", fix="send a JSON object.")
    if "kv_transfer_params" in body:
        raise InvalidRequestError("unrecognized request argument supplied: kv_transfer_params.",
                                  fix="remove it: the router sets it.", param="kv_transfer_params")
    if body.get("n", 1) != 1:
        raise InvalidRequestError("the PD router serves one sequence a request (n=1).", fix="send n=1.", param="n")
    return body


class RouterMetrics:
    """The router's own ``/metrics`` (each instance keeps its own): requests by the stage that
    answered and its status, requests in flight per instance, and the errors the guard answered."""

    def __init__(self, router: PDRouter) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.requests = Counter("fdplug_router:requests", "Requests answered, by the stage that answered.",
                                ["stage", "status"], registry=self.registry)
        self.errors = Counter("fdplug_router:http_errors", "Requests the router refused itself.", ["status"],
                              registry=self.registry)
        in_flight = Gauge("fdplug_router:in_flight", "Requests in flight at each instance.", ["role", "url"],
                          registry=self.registry)
        for role, pool in (("prefill", router.prefill), ("decode", router.decode)):
            for upstream in pool:
                in_flight.labels(role, upstream.url).set_function(lambda u=upstream: u.in_flight)

    def http_error(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    async def route(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def run_router(prefill: list[str], decode: list[str], host: str, port: int, api_key: str | None,
               max_body_bytes: int) -> int:
    """Serve until a signal; the exit status."""
    import uvicorn

    from fdplug.server.app import Guard
    from fdplug.server.settings import env

    router = PDRouter(prefill, decode, env("FDPLUG_ROUTER_PREFILL_TIMEOUT"), env("FDPLUG_ENGINE_STALL_TIMEOUT"))
    key = api_key if api_key is not None else env("FDPLUG_API_KEY")
    logger.info("fdplug router on http://%s:%d: prefill %s, decode %s", host, port, ", ".join(prefill),
                ", ".join(decode))
    from fdplug.server.launcher import _Server

    config = uvicorn.Config(Guard(router.app, key, max_body_bytes, router.metrics), host=host, port=port,
                            log_config=None, log_level="warning", access_log=False, lifespan="off")
    _Server(config, on_signal=lambda: None).run()    # a signal is a normal stop: status 0
    return 0
