"""What the scheduler hands the model runner each step, and what it hands the engine back.

Shapes follow vLLM v1 (``SchedulerOutput``, ``NewRequestData``, ``CachedRequestData``,
``EngineCoreOutput``) so a runner written against vLLM's reads naturally. Everything here is plain
data (lists, dicts, ints) so it can cross a process boundary.

Runner contract, per step:
  1. drop every id in ``finished_req_ids`` and ``preempted_req_ids`` from the batch (unknown ids
     are fine: a request preempted earlier may be aborted while waiting);
  2. add ``scheduled_new_reqs`` (a request resumed after preemption comes back here in full, with
     the tokens it had generated in ``output_token_ids``; the runner had forgotten it);
  3. append ``new_block_ids`` of ``scheduled_cached_reqs``;
  4. run ``num_scheduled_tokens[req_id]`` tokens of each request, starting at position
     ``num_computed_tokens``, and sample one token for each request whose last scheduled token
     is its last known token (others are mid-prefill: anything sampled for them is ignored).
Block ids never include the null block 0; use 0 to pad block tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fdplug.core.engine.request import MMPlaceholder, Request, SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner does not hold yet: everything it needs to start it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit: KV of these tokens is already in block_ids
    output_token_ids: list[int] = field(default_factory=list)  # non-empty only when resumed
    mm_positions: list[MMPlaceholder] = field(default_factory=list)
    resumed_from_preemption: bool = False

    @classmethod
    def from_request(cls, request: Request, block_ids: list[int], resumed: bool) -> NewRequestData:
        return cls(request.request_id, request.prompt_token_ids, request.sampling_params, block_ids,
                   request.num_computed_tokens, list(request.output_token_ids), request.mm_positions,
                   resumed)


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: the blocks added this step, and where it resumes."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work. ``num_scheduled_tokens`` maps request id -> tokens to run this step."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: list[str]
    finished_req_ids: set[str]  # finished or aborted since the previous step
    # mm_hash -> features [rows, hidden] of every item that overlaps a token scheduled this step.
    # Filled by the engine from the encoder cache; lives for one step, so no step sees stale features.
    mm_features: dict[str, Any] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


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
