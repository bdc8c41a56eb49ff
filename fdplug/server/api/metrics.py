"""Prometheus metrics for ``GET /metrics``, in a registry of their own (not the global one).

Names follow vLLM's (``vllm:num_requests_running`` -> ``fdplug:num_requests_running``) so existing
dashboards carry over. Gauges about the engine's state (running, waiting, KV usage, prefix cache)
come from the engine's stats messages; latencies and token counts are measured here, in the API
process, where a client sees them: time to first token from the moment the request arrived.
"""

from __future__ import annotations

from dataclasses import replace

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
        self._engines: dict[int, SchedulerStats] = {}      # each engine's last stats (data parallel: several)
        self._prefix_totals: dict[int, tuple[int, int]] = {}
        self._alive: set[int] = set()
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
        self.engine_alive = Gauge("fdplug:engine_alive", "Engine processes running (data parallel: of several).",
                                  label, registry=r)
        per_engine = ["model_name", "engine"]
        self.engine_running = Gauge("fdplug:engine_num_requests_running", "Sequences running, per engine.", per_engine,
                                    registry=r)
        self.engine_waiting = Gauge("fdplug:engine_num_requests_waiting", "Sequences waiting, per engine.", per_engine,
                                    registry=r)
        self.engine_kv_usage = Gauge("fdplug:engine_kv_cache_usage_perc", "KV cache blocks in use (0-1), per engine.",
                                     per_engine, registry=r)
        self.engine_up = Gauge("fdplug:engine_up", "1 while this engine process runs.", per_engine, registry=r)
        self.engine_requests = Counter("fdplug:engine_requests", "Requests sent to this engine.", per_engine,
                                       registry=r)
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

    def update_engine(self, stats: SchedulerStats, engine: int = 0) -> None:
        """Engine ``engine``'s stats: its own gauges, and the totals over every engine's last stats
        (sums; KV usage as the mean fraction; the hit rate from the summed token counts)."""
        self._engines[engine] = stats
        labels = (self.model_name, str(engine))
        self.engine_running.labels(*labels).set(stats.num_running)
        self.engine_waiting.labels(*labels).set(stats.num_waiting)
        self.engine_kv_usage.labels(*labels).set(stats.kv_cache_usage)
        every = list(self._engines.values())
        self.running.set(sum(s.num_running for s in every))
        self.waiting.set(sum(s.num_waiting for s in every))
        self.kv_usage.set(sum(s.kv_cache_usage for s in every) / len(every))
        self.preemptions.set(sum(s.num_preemptions for s in every))
        queries = sum(s.prefix_cache_queries for s in every)
        self.prefix_hit_rate.set(sum(s.prefix_cache_hits for s in every) / queries if queries else 0.0)
        # the engine reports totals; counters take increments (a reset prefix cache restarts them)
        last_queries, last_hits = self._prefix_totals.get(engine, (0, 0))
        if stats.prefix_cache_queries >= last_queries:
            self.prefix_queries.inc(stats.prefix_cache_queries - last_queries)
            self.prefix_hits.inc(max(0, stats.prefix_cache_hits - last_hits))
        self._prefix_totals[engine] = (stats.prefix_cache_queries, stats.prefix_cache_hits)

    def engine_alive_is(self, engine: int, alive: bool) -> None:
        """Engine ``engine`` started or died: a dead engine holds no requests and no KV cache."""
        (self._alive.add if alive else self._alive.discard)(engine)
        self.engine_alive.set(len(self._alive))
        self.engine_up.labels(self.model_name, str(engine)).set(int(alive))
        if not alive and engine in self._engines:
            self.update_engine(replace(self._engines[engine], num_running=0, num_waiting=0,
                                       num_waiting_for_features=0, kv_cache_usage=0.0), engine)

    def finished(self, finish_reason: str) -> None:
        self.requests.labels(self.model_name, finish_reason).inc()

    def http_error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
