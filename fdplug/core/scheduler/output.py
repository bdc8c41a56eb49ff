"""What the scheduler hands the engine back each step: `EngineCoreOutput`, and its `SchedulerStats`.

What it hands the model runner (`SchedulerOutput` and its parts) is part of the plugin contract:
`fdplug.plugin_api.scheduled_work`; ``new_request_data`` builds one entry of it from a `Request`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fdplug.core.request import Request
from fdplug.plugin_api.scheduled_work import NewRequestData


def new_request_data(request: Request, block_ids: list[int], resumed: bool) -> NewRequestData:
    """What the runner needs to start ``request`` (again, when ``resumed`` after preemption)."""
    return NewRequestData(request.request_id, request.prompt_token_ids, request.sampling_params, block_ids,
                          request.num_computed_tokens, list(request.output_token_ids), request.mm_positions,
                          resumed)


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's result of a step: tokens to detokenize, and whether it is done."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" (| "abort" | "error" from the engine)
    stop_reason: int | str | None = None  # the stop token id, when a stop_token_ids entry ended it
    num_cached_tokens: int = 0
    # One entry per new token when the request asked for logprobs: (token ids, logprobs, ranks),
    # the sampled token first, then the top-N alternatives, from the runner's ModelRunnerOutput.
    new_logprobs: list[tuple[list[int], list[float], list[int]]] | None = None
    error: dict | None = None   # with finish_reason "error": the typed error as data (errors.error_to_dict)
    kv_transfer_params: dict | None = None   # PD prefill, finished: what a decode instance pulls


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot for metrics (Prometheus gauges and counters)."""

    num_running: int
    num_waiting: int
    num_waiting_for_features: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
