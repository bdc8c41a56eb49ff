"""``fdplug router``'s own ``/metrics`` (each instance keeps its own)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

if TYPE_CHECKING:
    from fdplug.server.router.pd_router import PDRouter


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
        Gauge("fdplug_router:requests_in_flight", "Client requests let in and not answered to the end yet.",
              registry=self.registry).set_function(lambda: router.drain.active)
        for role, pool in (("prefill", router.prefill), ("decode", router.decode)):
            for upstream in pool:
                in_flight.labels(role, upstream.url).set_function(lambda u=upstream: u.in_flight)

    def http_error(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    async def route(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
