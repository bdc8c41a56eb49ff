"""Multimodal split points: legal chunk ends, prefix-hit cut-back, balanced planning and admission,
checked against brute-force definitions (all legal points, a DP over every plan) on small prompts."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fdplug.core.multimodal.chunking import ChunkPlan, check_admission, cut_back_hit, legal_end, plan_chunks
from fdplug.errors import InvalidRequestError
from fdplug.plugin_api.scheduled_work import spans


@dataclass(frozen=True, slots=True)
class Item:  # MMPlaceholder with the span_length field the scheduler will add
    offset: int
    length: int
    mm_hash: str = "h"
    span_length: int = 0


@st.composite
def prompts(draw, max_tokens: int = 40):
    """(num_tokens, sorted non-overlapping spans): random gaps, span lengths 1..12, adjacent spans too."""
    n = draw(st.integers(0, max_tokens))
    out, p = [], 0
    while True:
        p += draw(st.integers(0, 6))
        length = draw(st.integers(1, 12))
        if p + length > n or draw(st.integers(0, 5)) == 0:
            return n, out
        out.append((p, p + length))
        p += length


def legal_points(n: int, sp) -> list[int]:
    return [p for p in range(n + 1) if not any(s < p < e for s, e in sp)]


def brute(n: int, sp, budget: int, start: int):
    """(fewest chunks, smallest largest non-oversize chunk) by DP over every legal plan; a chunk over
    the budget is allowed only when it is exactly one span (the documented oversize rule)."""
    legal = [p for p in legal_points(n, sp) if p >= start]
    big = {(s, e) for s, e in sp if e - s > budget}

    def fewest(cap: int) -> float:
        best = {start: 0}
        for q in legal[1:]:
            best[q] = min((best[p] + 1 for p in legal if p < q and best[p] < math.inf
                           and (q - p <= cap or (p, q) in big)), default=math.inf)
        return best[n]

    k = fewest(budget)
    return k, min(c for c in range(budget + 1) if fewest(c) == k)  # cap 0: oversize only


def check_plan(n: int, sp, budget: int, start: int, plan: ChunkPlan) -> None:
    legal = set(legal_points(n, sp))
    assert len(plan.ends) == len(plan.oversize)
    assert plan.ends == sorted(set(plan.ends)) and (plan.ends[-1] == n if plan.ends else n == start)
    prev = start
    for end, big in zip(plan.ends, plan.oversize):
        assert end in legal and end > prev
        if big:
            assert (prev, end) in sp and end - prev > budget
        else:
            assert end - prev <= budget
        prev = end


# ---------------------------------------------------------------------------------------------------


def test_spans_tile_items():
    items = [Item(30, 7, span_length=3), Item(0, 5, span_length=5), Item(10, 4), Item(20, 3, span_length=1),
             Item(40, 7, span_length=6)]
    # the video's last span is shorter; causal and one-token spans constrain nothing
    assert spans(items) == [(0, 5), (30, 33), (33, 36), (40, 46)]
    assert spans([Item(40, 7, span_length=6)]) == [(40, 46)]  # a 1-token tail is dropped
    assert spans([Item(0, 0, span_length=4)]) == []


def test_spans_accept_todays_placeholder_without_span_length():
    @dataclass(frozen=True, slots=True)
    class Old:
        offset: int
        length: int
        mm_hash: str

    assert spans([Old(0, 9, "h")]) == []


def test_spans_of_the_real_placeholder():
    from fdplug.plugin_api.scheduled_work import MMPlaceholder
    assert spans([MMPlaceholder(4, 10, "v", span_length=4), MMPlaceholder(0, 3, "i")]) == [(4, 8), (8, 12),
                                                                                        (12, 14)]


def test_spans_reject_negative_sizes():
    with pytest.raises(InvalidRequestError, match="span_length -2"):
        spans([Item(0, 4, span_length=-2)])


@settings(max_examples=300, deadline=None)
@given(prompts(), st.data())
def test_legal_end_and_cut_back_match_brute_force(prompt, data):
    n, sp = prompt
    legal = legal_points(n, sp)
    start = data.draw(st.sampled_from(legal))
    end = data.draw(st.integers(start, n))
    assert legal_end(sp, start, end) == max([p for p in legal if start < p <= end], default=start)
    hit = data.draw(st.integers(0, n))
    assert cut_back_hit(sp, hit) == max(p for p in legal if p <= hit)


@settings(max_examples=300, deadline=None)
@given(prompts(), st.integers(1, 14), st.data())
def test_plan_is_legal_and_optimal(prompt, budget, data):
    n, sp = prompt
    start = data.draw(st.sampled_from(legal_points(n, sp)))
    plan = plan_chunks(n, sp, budget, start)
    check_plan(n, sp, budget, start, plan)
    k, c = brute(n, sp, budget, start)
    assert len(plan.ends) == k
    sizes = [e - p for p, e, big in zip([start] + plan.ends, plan.ends, plan.oversize) if not big]
    assert max(sizes, default=0) == c


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.integers(1, 64), st.data())
def test_causal_only_is_fewest_chunks_of_smallest_max(n, budget, data):
    start = data.draw(st.integers(0, n))
    plan = plan_chunks(n, [], budget, start)
    k = -(-(n - start) // budget)
    assert len(plan.ends) == k and not any(plan.oversize)
    sizes = [e - p for p, e in zip([start] + plan.ends, plan.ends)]
    assert max(sizes, default=0) == (-(-(n - start) // k) if k else 0)
    check_plan(n, [], budget, start, plan)


@pytest.mark.parametrize("n, sp, budget, start, ends, oversize", [
    (10, [(0, 4)], 4, 0, [4, 8, 10], [False] * 3),            # span at the start, exactly the budget
    (10, [(0, 4)], 5, 0, [5, 10], [False] * 2),                # 0..4 fits with one text token
    (10, [(6, 10)], 3, 0, [3, 6, 10], [False, False, True]),   # oversize span at the very end
    (10, [(2, 6)], 3, 0, [2, 6, 8, 10], [False, True, False, False]),
    (12, [(2, 5), (5, 8), (8, 11)], 3, 0, [2, 5, 8, 11, 12], [False] * 5),  # adjacent spans
    (12, [(2, 5), (5, 8), (8, 11)], 6, 0, [5, 8, 12], [False] * 3),   # max 5, not 6
    (8, [(1, 3), (5, 7)], 1, 0, [1, 3, 4, 5, 7, 8], [False, True, False, False, True, False]),  # budget 1
    (20, [(3, 9)], 4, 9, [13, 17, 20], [False] * 3),           # the rest of a partially computed prompt
    (20, [(3, 9)], 4, 20, [], []),                             # nothing left
    (0, [], 3, 0, [], []),
])
def test_edge_cases(n, sp, budget, start, ends, oversize):
    plan = plan_chunks(n, sp, budget, start)
    assert (plan.ends, plan.oversize) == (ends, oversize)
    check_plan(n, sp, budget, start, plan)


def test_plan_rejects_a_start_inside_a_span_and_bad_budget():
    with pytest.raises(ValueError, match="inside"):
        plan_chunks(10, [(2, 6)], 4, start=3)
    with pytest.raises(ValueError, match="budget"):
        plan_chunks(10, [], 0)


def test_large_prompt_plans_legally():
    rng = random.Random(0)
    n, sp, p = 200_000, [], 0
    for _ in range(500):  # ~150k span tokens (up to 599 each) among ~50k text tokens
        p += rng.randrange(0, 200)
        length = rng.randrange(2, 600)
        sp.append((p, p + length))
        p += length
    assert p <= n
    for budget in (1, 512, 1024, 8192):
        plan = plan_chunks(n, sp, budget)
        assert plan.ends[-1] == n and len(plan.ends) == len(plan.oversize)
        prev, j = 0, 0
        for end, big in zip(plan.ends, plan.oversize):
            assert (end - prev <= budget) != big
            while j < len(sp) and sp[j][1] <= end:
                j += 1
            assert j == len(sp) or sp[j][0] >= end  # not inside a span
            prev = end


def test_admission():
    check_admission(100, [(0, 50), (50, 90)], budget=16, max_model_len=128)  # over the budget: allowed
    with pytest.raises(InvalidRequestError, match=r"300 tokens.*max_model_len \(128\)"):
        check_admission(400, [(10, 310)], budget=16, max_model_len=128)
    with pytest.raises(InvalidRequestError, match="outside the prompt"):
        check_admission(100, [(90, 110)], budget=16, max_model_len=128)
    with pytest.raises(InvalidRequestError, match="outside the prompt"):
        check_admission(100, [(-1, 3)], budget=16, max_model_len=128)
    with pytest.raises(InvalidRequestError, match="overlap"):
        check_admission(100, [(0, 10), (5, 20)], budget=16, max_model_len=128)
    check_admission(100, spans([Item(0, 7, span_length=3), Item(7, 2, span_length=2)]), 4, 128)
