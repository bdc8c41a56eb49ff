"""What the scheduler hands the model runner each step: `SchedulerOutput`, and the types inside it.

Shapes follow vLLM v1 (``SchedulerOutput``, ``NewRequestData``, ``CachedRequestData``) so a runner
written against vLLM's reads naturally. Everything here is plain
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

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fdplug.errors import InvalidRequestError
from fdplug.plugin_api.sampling_params import SamplingParams

Span = tuple[int, int]


class PlaceholderLike(Protocol):
    """What ``spans`` reads of an item (``MMPlaceholder``); a missing ``span_length`` means causal."""

    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class MMPlaceholder:
    """A multimodal item's placeholder tokens in the prompt: ``[offset, offset + length)``.

    ``mm_hash`` identifies the item's content; it enters the hash of every KV block the item
    overlaps, so two prompts with the same placeholder tokens but different images never share KV.
    ``span_length`` > 0 tiles the item into spans of that many tokens (the last may be shorter)
    whose tokens attend bidirectionally within their span (an image: one span; a video: one span
    per 2 frames); 0 means the item's tokens are causal like text.

    ``grid_thw`` is the item's patch grid ``(t, h, w)`` as its encoder saw it and ``modality`` its
    kind (``image``, ``video``): a model with multimodal RoPE places the item's tokens by them
    (`fdplug.core.multimodal.positions`); empty for a caller that has no grid (positions as text).
    """

    offset: int
    length: int
    mm_hash: str
    span_length: int = 0
    grid_thw: tuple[int, ...] = ()
    modality: str = "image"

    @property
    def end(self) -> int:
        return self.offset + self.length


def spans(items: Iterable[PlaceholderLike]) -> list[Span]:
    """The bidirectional spans of ``items``, sorted. One-token spans are left out: they have no interior."""
    out: list[Span] = []
    for item in items:
        span_length = getattr(item, "span_length", 0)
        if span_length < 0 or item.length < 0:
            raise InvalidRequestError(
                f"a multimodal item at offset {item.offset} has length {item.length} and span_length "
                f"{span_length}; both must be >= 0.", fix="send non-negative placeholder sizes.")
        if span_length <= 1:
            continue
        end = item.offset + item.length
        out.extend((s, min(s + span_length, end)) for s in range(item.offset, end, span_length)
                   if min(s + span_length, end) - s > 1)
    out.sort()
    return out


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


