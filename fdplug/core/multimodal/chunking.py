"""Where a prefill chunk may end when multimodal tokens attend bidirectionally.

An item whose ``span_length`` is > 0 is tiled into consecutive spans of that many tokens (an image:
one span, the whole item; a video: one span per two frames; the last span may be shorter). Every
token of a span sees the whole span, so a chunk that ends strictly inside a span would compute KV
without the rest of it: a chunk end (and a prefix-cache hit) must lie outside every span's interior.
``span_length == 0`` means causal: the item constrains nothing.

Spans are ``(start, end)`` half-open tuples, sorted and non-overlapping (``check_admission`` says so
for a request). Positions outside the strict interiors ``start < p < end`` are *legal* split points.

**Oversize rule.** A span longer than the token budget fits no chunk; it becomes its own chunk,
exactly ``[start, end)`` (no text, no other span with it), and the text on either side is planned
independently. Admission only asks that such a span fits ``max_model_len``.

Pure Python (bisect only): the scheduler calls this every step, for prompts of 100k+ tokens.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from fdplug.errors import InvalidRequestError
from fdplug.plugin_api.attention import cdiv
from fdplug.plugin_api.scheduled_work import Span


@dataclass(slots=True)
class ChunkPlan:
    """Chunk end positions (increasing, the last is ``num_tokens``); ``oversize[i]`` marks a chunk that
    is exactly one span longer than the budget."""

    ends: list[int]
    oversize: list[bool]


def _inside(spans: Sequence[Span], pos: int) -> Span | None:
    """The span whose strict interior holds ``pos``, or None. O(log n)."""
    i = bisect_left(spans, (pos,)) - 1  # the last span starting before pos
    if i >= 0 and spans[i][1] > pos:
        return spans[i]
    return None


def legal_end(spans: Sequence[Span], start: int, end: int) -> int:
    """The largest legal chunk end in ``(start, end]``, or ``start`` when there is none (the span at
    ``start`` is longer than the room). ``start`` is assumed legal."""
    span = _inside(spans, end)
    if span is None:
        return end
    return max(span[0], start)


def cut_back_hit(spans: Sequence[Span], num_hit_tokens: int) -> int:
    """A prefix-cache hit that ends inside a span is cut back to the span's start: that span's KV was
    computed with all of it, but the chunk recomputing the rest must compute the whole span."""
    span = _inside(spans, num_hit_tokens)
    return num_hit_tokens if span is None else span[0]


def _greedy(spans: Sequence[Span], a: int, b: int, cap: int, limit: float = math.inf,
            ends: list[int] | None = None) -> float:
    """Chunks the farthest-jump greedy needs for ``[a, b)`` with chunks <= ``cap`` (inf: impossible).

    Farthest-first is optimal: from a later point the farthest reachable point is never earlier. Text
    runs are crossed in one arithmetic jump, so a probe costs O(#spans log), not O(#tokens). Stops once
    over ``limit``. Appends the chunk ends to ``ends`` when given.
    """
    j = bisect_left(spans, (a,))  # spans starting at or after a (a is legal)
    count, p = 0, a
    while p < b and count <= limit:
        while j < len(spans) and spans[j][0] < p:
            j += 1
        barrier = min(spans[j][0], b) if j < len(spans) else b
        if barrier - p >= cap:  # all-legal text: whole steps of exactly cap
            m = (barrier - p) // cap
            if ends is not None:
                ends.extend(range(p + cap, p + m * cap + 1, cap))
            count, p = count + m, p + m * cap
            continue
        q = legal_end(spans, p, min(p + cap, b))
        if q == p:
            return math.inf
        count, p = count + 1, q
        if ends is not None:
            ends.append(q)
    return count if p >= b else math.inf


def _plan_segment(spans: Sequence[Span], a: int, b: int, budget: int, ends: list[int]) -> None:
    """Fewest chunks for ``[a, b)`` (no oversize span inside), then the smallest largest chunk.

    Any cap <= budget that the greedy covers in k_min chunks gives a minimum-count plan, and
    feasibility is monotone in the cap: binary search the cap between ceil(L / k_min) and budget.
    """
    k_min = _greedy(spans, a, b, budget)
    lo, hi = cdiv(b - a, k_min), budget
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy(spans, a, b, mid, limit=k_min) <= k_min:
            hi = mid
        else:
            lo = mid + 1
    _greedy(spans, a, b, lo, ends=ends)


def plan_chunks(num_tokens: int, spans: Sequence[Span], budget: int, start: int = 0) -> ChunkPlan:
    """Split ``[start, num_tokens)`` into the fewest legal chunks of <= ``budget`` tokens, minimising
    the largest one; each span longer than ``budget`` is its own oversize chunk.

    Each text/span stretch between oversize spans is balanced on its own (a stronger result than
    minimising the overall maximum). Spans must lie inside ``[0, num_tokens)``.
    """
    if budget < 1 or not 0 <= start <= num_tokens:
        raise ValueError(f"need budget >= 1 and 0 <= start <= num_tokens; got budget={budget}, "
                         f"start={start}, num_tokens={num_tokens}")
    if (span := _inside(spans, start)) is not None:
        raise ValueError(f"start {start} is inside the bidirectional span {span}")
    ends: list[int] = []
    oversize: list[bool] = []
    a = start
    for s, e in spans[bisect_left(spans, (start,)):]:
        if e - s <= budget:
            continue
        if s > a:
            _plan_segment(spans, a, s, budget, ends)
        oversize.extend([False] * (len(ends) - len(oversize)) + [True])
        ends.append(e)
        a = e
    if num_tokens > a:
        _plan_segment(spans, a, num_tokens, budget, ends)
    oversize.extend([False] * (len(ends) - len(oversize)))
    return ChunkPlan(ends, oversize)


def check_admission(num_prompt_tokens: int, spans: Sequence[Span], budget: int, max_model_len: int) -> None:
    """Reject at admission what could never be scheduled: a span over ``max_model_len`` (one over the
    budget is fine: it runs alone in an oversize step), and spans that are empty, overlap or lie
    outside the prompt."""
    prev_end, prev = 0, None
    for s, e in spans:
        if e - s > max_model_len:
            raise InvalidRequestError(
                f"a multimodal item's bidirectional span [{s}, {e}) has {e - s} tokens, more than "
                f"max_model_len ({max_model_len}); spans over the token budget ({budget}) run alone, but "
                f"must still fit max_model_len.", fix="send a smaller image or fewer frames per span.")
        if not 0 <= s < e <= num_prompt_tokens:
            raise InvalidRequestError(
                f"the multimodal span [{s}, {e}) is empty or lies outside the prompt's "
                f"{num_prompt_tokens} tokens.", fix="place each item's placeholder tokens inside the prompt.")
        if s < prev_end:
            raise InvalidRequestError(
                f"the multimodal spans {prev} and [{s}, {e}) overlap (or are not sorted by start).",
                fix="give each item its own placeholder tokens.")
        prev_end, prev = e, f"[{s}, {e})"
