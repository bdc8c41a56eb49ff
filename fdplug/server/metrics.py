"""Prometheus metrics for ``GET /metrics``, in a registry of their own (not the global one).

Names follow vLLM's (``vllm:num_requests_running`` -> ``fdplug:num_requests_running``) so existing
dashboards carry over. Gauges about the engine's state (running, waiting, KV usage, prefix cache)
come from the engine's stats messages; latencies and token counts are measured here, in the API
process, where a client sees them: time to first token from the moment the request arrived.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the app)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from fdplug.core.scheduler.output import SchedulerStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class ServerMetrics:
    """Every metric the server exports; ``model_name`` is the label value of all of them."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._prefix_queries = self._prefix_hits = 0
        r, label = self.registry, ["model_name"]
        self.running = Gauge("fdplug:num_requests_running", "Sequences in the running batch.", label, registry=r)
        self.waiting = Gauge("fdplug:num_requests_waiting", "Sequences waiting to be scheduled.", label, registry=r)
        self.kv_usage = Gauge("fdplug:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", label,
                              registry=r)
        self.prefix_hit_rate = Gauge("fdplug:prefix_cache_hit_rate",
                                     "Prefix cache hits / queries, in tokens, since start (0-1).", label, registry=r)
        self.prefix_queries = Counter("fdplug:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      label, registry=r)
        self.prefix_hits = Counter("fdplug:prefix_cache_hits", "Prompt tokens found in the prefix cache.", label,
                                   registry=r)
        self.preemptions = Gauge("fdplug:num_preemptions", "Preemptions since start.", label, registry=r)
        self.engine_alive = Gauge("fdplug:engine_alive", "1 while the engine process runs.", label, registry=r)
        self.ttft = Histogram("fdplug:time_to_first_token_seconds", "Time to first token.", label,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("fdplug:inter_token_latency_seconds", "Time between two output tokens.", label,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("fdplug:e2e_request_latency_seconds", "Request latency, arrival to last token.", label,
                             buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("fdplug:prompt_tokens", "Prompt tokens admitted.", label, registry=r)
        self.generation_tokens = Counter("fdplug:generation_tokens", "Tokens generated.", label, registry=r)
        self.requests = Counter("fdplug:request_success", "Finished requests, by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.http_errors = Counter("fdplug:http_errors", "Error responses, by status code.", ["model_name", "status"],
                                   registry=r)
        # bound children: labels() costs a dict lookup and a lock each call
        for name in ("running", "waiting", "kv_usage", "prefix_hit_rate", "prefix_queries", "prefix_hits",
                     "preemptions", "engine_alive", "ttft", "itl", "e2e", "prompt_tokens", "generation_tokens"):
            setattr(self, name, getattr(self, name).labels(self.model_name))

    def update_engine(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        self.preemptions.set(stats.num_preemptions)
        # the engine reports totals; counters take increments (a reset prefix cache restarts them)
        if stats.prefix_cache_queries >= self._prefix_queries:
            self.prefix_queries.inc(stats.prefix_cache_queries - self._prefix_queries)
            self.prefix_hits.inc(max(0, stats.prefix_cache_hits - self._prefix_hits))
        self._prefix_queries, self._prefix_hits = stats.prefix_cache_queries, stats.prefix_cache_hits

    def finished(self, finish_reason: str) -> None:
        self.requests.labels(self.model_name, finish_reason).inc()

    def http_error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
