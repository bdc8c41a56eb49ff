"""``fdplug router``'s own ``/metrics`` (each instance keeps its own)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response


class RouterMetrics:
    """The router's own ``/metrics`` (each instance keeps its own): requests by the stage that
    answered and its status, requests in flight per instance, and the errors the guard answered."""

    def __init__(self, active: Callable[[], int], pools: Iterable[tuple[str, Iterable[Any]]]) -> None:
        """``active``: the client requests let in and not answered yet (the drain's count); ``pools``:
        (role, its upstreams), each upstream with its ``url`` and ``in_flight``."""
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.requests = Counter("fdplug_router:requests", "Requests answered, by the stage that answered.",
                                ["stage", "status"], registry=self.registry)
        self.errors = Counter("fdplug_router:http_errors", "Requests the router refused itself.", ["status"],
                              registry=self.registry)
        in_flight = Gauge("fdplug_router:in_flight", "Requests in flight at each instance.", ["role", "url"],
                          registry=self.registry)
        Gauge("fdplug_router:requests_in_flight", "Client requests let in and not answered to the end yet.",
              registry=self.registry).set_function(active)
        for role, pool in pools:
            for upstream in pool:
                in_flight.labels(role, upstream.url).set_function(lambda u=upstream: u.in_flight)

    def http_error(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    async def route(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
