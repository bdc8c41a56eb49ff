"""Scheduler: token budget, chunked prefill, preemption, abort, admission, stop rules, and a
simulated engine loop whose fake runner keeps a fake KV cache, so any block mix-up changes tokens."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fdplug.core.request import Request, RequestStatus
from fdplug.core.scheduler.scheduler import Scheduler, SchedulerConfig
from fdplug.errors import ConfigError, InvalidRequestError, QueueFullError
from fdplug.plugin_api.model_runner import ModelRunnerOutput
from fdplug.plugin_api.sampling_params import SamplingParams
from fdplug.plugin_api.scheduled_work import MMPlaceholder, SchedulerOutput

V = 50  # vocabulary of the fake models


def make(**kw) -> Scheduler:
    cfg = dict(max_model_len=64, num_kv_blocks=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


def req(rid: str, n_prompt: int = 8, start: int = 0, eos: int | None = None, **params) -> Request:
    params.setdefault("max_tokens", 16)
    return Request(rid, [(start + i) % V for i in range(n_prompt)], SamplingParams(**params),
                   eos_token_ids=() if eos is None else (eos,))


def step(s: Scheduler, sampled: dict[str, list[int]] | None = None):
    """One engine step with the fake model next = (last token + 1) % V."""
    out = s.schedule()
    if sampled is None:
        sampled = {rid: [(s.requests[rid].all_token_ids[-1] + 1) % V] for rid in out.num_scheduled_tokens}
    return out, s.update_from_output(out, ModelRunnerOutput(sampled))


def free_blocks(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


# ---------------------------------------------------------------------------------------------------
# configuration and validation
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
    (dict(block_size=12), "power of two"),
    (dict(max_model_len=1), "max_model_len must be >= 2"),
    (dict(num_kv_blocks=16), "lower max_model_len to at most 60"),
    (dict(max_num_batched_tokens=4, max_num_seqs=8), "max_num_batched_tokens >= 8"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=32), "enable chunked prefill"),
    (dict(max_waiting_requests=0), "max_waiting_requests must be a positive integer"),
])
def test_config_errors_name_the_value_and_the_fix(kw, match):
    with pytest.raises(ConfigError, match=match) as info:
        make(**kw)
    assert info.value.fix


def test_config_minimum_kv_cache_is_one_full_length_request():
    make(num_kv_blocks=17)  # 16 blocks of 4 hold max_model_len=64, plus the null block
    make(enable_chunked_prefill=False, max_num_batched_tokens=64)


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-0.5), r"temperature must be in \[0, 100\]"),
    (dict(temperature=100.5), r"temperature must be in \[0, 100\]"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k must be -1 or 0"),
    (dict(top_k=2**31), "top_k must be -1 or 0"),
    (dict(top_k=2**63), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(n=0), r"n must be an integer in \[1, 128\]"),
    (dict(n=129), r"n must be an integer in \[1, 128\]"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2**63), "max_tokens"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(max_tokens=None, min_tokens=2**64), "min_tokens"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=1e-40), "repetition_penalty"),
    (dict(repetition_penalty=101), "repetition_penalty"),
    (dict(logprobs=21), r"logprobs must be null or an integer in \[0, 20\]"),
    (dict(stop=("ok", "")), "non-empty strings"),
    (dict(stop=("x" * 1025,)), "at most 1024 characters"),
    (dict(stop=tuple("abcdefghijklmnopqrstuvwxyz" * 3)), "at most 64 strings"),
    (dict(stop=5), "stop must be"),
    (dict(stop_token_ids=(5, -1)), "stop_token_ids"),
    (dict(stop_token_ids=tuple(range(1025))), "at most 1024"),
    (dict(seed=1.5), "seed"),
    (dict(seed=2**63), "seed must be null or a 64-bit signed integer"),
    (dict(seed=-(2**63) - 1), "seed"),
    (dict(seed=10**5000), "an integer of"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_sampling_params_validation(kw, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        SamplingParams(**kw).validate()
    assert info.value.http_status == 400 and info.value.fix
    assert info.value.param in kw or info.value.param == "min_tokens", info.value.param


def test_sampling_params_edges_are_valid():
    for kw in (dict(temperature=100), dict(top_k=2**31 - 1), dict(seed=2**63 - 1), dict(seed=-(2**63)),
               dict(repetition_penalty=0.01), dict(repetition_penalty=100), dict(n=128), dict(logprobs=20),
               dict(stop=("x" * 1024,) * 64), dict(stop_token_ids=tuple(range(1024)))):
        SamplingParams(**kw).validate()


def test_child_seeds_wrap_within_64_bits():
    from fdplug.plugin_api.sampling_params import child_seed

    assert child_seed(None, 3) is None and child_seed(7, 2) == 9
    assert child_seed(2**63 - 1, 1) == -(2**63) and child_seed(2**63 - 1, 0) == 2**63 - 1


def test_sampling_params_defaults_and_normalisation():
    params = SamplingParams(stop="###", stop_token_ids=[7]).validate()
    assert params.stop == ("###",) and params.stop_token_ids == (7,)
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
    SamplingParams(top_k=-1, max_tokens=None, seed=3, logprobs=0).validate()


@pytest.mark.parametrize("kw, match", [
    (dict(prompt_token_ids=[]), "prompt is empty"),
    (dict(prompt_token_ids=[1, -2]), ">= 0"),
    (dict(mm_positions=[MMPlaceholder(2, 4, "a"), MMPlaceholder(4, 2, "b")]), "overlaps"),
    (dict(mm_positions=[MMPlaceholder(6, 4, "a")]), "outside"),
    (dict(request_id=""), "request_id"),
    (dict(sampling_params=SamplingParams(top_p=2)), "top_p"),
])
def test_request_validation(kw, match):
    args = dict(request_id="r", prompt_token_ids=list(range(8)))
    args.update(kw)
    with pytest.raises(InvalidRequestError, match=match):
        Request(**args)


# ---------------------------------------------------------------------------------------------------
# budget, chunking, ordering
# ---------------------------------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt():
    s = make(max_num_batched_tokens=8)
    s.add_request(req("a", 20))
    out, res = step(s, {"a": [42]})  # a token "sampled" mid-prefill is ignored
    assert out.num_scheduled_tokens == {"a": 8} and res == []
    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [("a", [1, 2], 0)]
    out, res = step(s, {"a": [42]})
    assert out.num_scheduled_tokens == {"a": 8} and res == []
    assert [(c.req_id, c.new_block_ids, c.num_computed_tokens) for c in out.scheduled_cached_reqs] == [("a", [3, 4], 8)]
    assert s.requests["a"].output_token_ids == []
    out, res = step(s)
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_cached_reqs[0].new_block_ids == [5]
    assert [(r.request_id, r.new_token_ids) for r in res] == [("a", [20])]
    out, _ = step(s)  # decode: position 20 opens block 6
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_cached_reqs[0].new_block_ids == [6]


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_fits():
    s = make(max_model_len=32, max_num_batched_tokens=32, enable_chunked_prefill=False)
    s.add_request(req("a", 10))
    s.add_request(req("b", 31, start=20))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 10}  # b needs 31 > 22 left: it waits whole
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 31}


def test_budget_max_num_seqs_and_running_before_waiting():
    s = make(max_num_batched_tokens=16, max_num_seqs=3)
    for i in range(5):
        s.add_request(req(f"r{i}", 10, start=i))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"r0": 10, "r1": 6}
    out, _ = step(s)
    assert list(out.num_scheduled_tokens.items()) == [("r0", 1), ("r1", 4), ("r2", 10)]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["r2"]  # r3 blocked by max_num_seqs, not budget
    for _ in range(20):
        out, _ = step(s)
        assert out.total_num_scheduled_tokens <= 16 and len(out.num_scheduled_tokens) <= 3
        assert len(s.running) <= 3


# ---------------------------------------------------------------------------------------------------
# preemption and abort
# ---------------------------------------------------------------------------------------------------


def test_newest_is_preempted_when_blocks_run_out_and_it_resumes_and_completes():
    s = make(max_model_len=16, num_kv_blocks=6, max_num_batched_tokens=16)  # 5 usable blocks
    s.add_request(req("a", 8, start=0, max_tokens=8))
    s.add_request(req("b", 8, start=20, max_tokens=8))
    out, _ = step(s)
    assert [n.block_ids for n in out.scheduled_new_reqs] == [[1, 2], [3, 4]]
    out, _ = step(s)  # both need a third block; one is free
    assert out.num_scheduled_tokens == {"a": 1} and out.preempted_req_ids == ["b"]
    assert out.scheduled_cached_reqs[0].new_block_ids == [5]
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert b.output_token_ids == [28] and s.make_stats().num_preemptions == 1
    while "a" in s.requests:
        out, _ = step(s)
        assert "b" not in out.num_scheduled_tokens  # no room until a finishes
    out, res = step(s)
    (resumed,) = out.scheduled_new_reqs
    assert resumed.req_id == "b" and resumed.resumed_from_preemption
    assert resumed.output_token_ids == [28]
    # b's block 3 survived in the prefix cache (a's last block evicted 4): 4 tokens re-hit
    assert resumed.num_computed_tokens == 4 and resumed.block_ids[0] == 3
    assert out.num_scheduled_tokens == {"b": 5}
    outputs = [28] + res[0].new_token_ids
    while "b" in s.requests:
        _, res = step(s)
        outputs += [t for r in res for t in r.new_token_ids]
    assert outputs == [(28 + i) % V for i in range(8)]
    assert b.finish_reason == "length" and free_blocks(s) == 5


def test_abort_frees_blocks_wherever_the_request_is():
    s = make(max_model_len=16, num_kv_blocks=6, max_num_batched_tokens=16, max_num_seqs=2)
    for rid in ("a", "b", "c"):
        s.add_request(req(rid, 8))
    step(s)
    step(s)  # b preempted, c waiting behind it
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    s.finish_requests(["b", "c", "nope"], RequestStatus.FINISHED_ABORTED)
    assert not s.waiting and set(s.requests) == {"a"}
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(s) == 5 and not s.has_unfinished_requests()
    out = s.schedule()
    assert out.finished_req_ids == {"a", "b", "c"} and out.is_empty
    assert s.schedule().finished_req_ids == set()  # reported once
    with pytest.raises(ValueError, match="not a finished status"):
        s.finish_requests("a", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_is_skipped():
    s = make()
    s.add_request(req("a"))
    s.add_request(req("b"))
    out = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    res = s.update_from_output(out, ModelRunnerOutput({"a": [1], "b": [2]}))
    assert [r.request_id for r in res] == ["b"] and free_blocks(s) == 63 - 2  # b holds 8 tokens


def test_a_request_the_runner_sampled_nothing_for_fails_alone():
    s = make()
    s.add_request(req("a"))
    s.add_request(req("b", start=3))
    out = s.schedule()
    res = s.update_from_output(out, ModelRunnerOutput({"b": [5]}))
    by_id = {r.request_id: r for r in res}
    assert by_id["a"].finished and by_id["a"].finish_reason == "error" and "no token" in by_id["a"].error["message"]
    assert by_id["b"].new_token_ids == [5] and not by_id["b"].finished
    assert "a" not in s.requests and [r.request_id for r in s.running] == ["b"]
    assert free_blocks(s) == 63 - 2     # a's blocks are back; b holds its 8 prompt tokens


def test_preempt_all_running_keeps_their_order_at_the_front():
    s = make()
    for rid in "abc":
        s.add_request(req(rid, start=ord(rid)))
    step(s)
    s.add_request(req("d"))
    assert s.preempt_all_running() == ["a", "b", "c"]
    assert [r.request_id for r in s.waiting] == ["a", "b", "c", "d"] and not s.running
    assert free_blocks(s) == 63 and all(s.requests[r].num_computed_tokens == 0 for r in "abc")


# ---------------------------------------------------------------------------------------------------
# admission
# ---------------------------------------------------------------------------------------------------


def test_full_queue_rejects_before_touching_any_state():
    s = make(max_waiting_requests=2)
    s.add_request(req("a"))
    s.add_request(req("b"))
    before = (s.make_stats(), list(s.requests), len(s.waiting))
    rejected = req("c", 63)
    with pytest.raises(QueueFullError, match="limit") as info:
        s.add_request(rejected)  # also too long: the admission check comes first
    assert info.value.http_status == 503 and info.value.fix
    assert (s.make_stats(), list(s.requests), len(s.waiting)) == before
    assert rejected.block_hashes == [] and rejected.num_computed_tokens == 0
    step(s)  # the queue drains into running
    s.add_request(req("c"))
    assert "c" in s.requests


def test_too_long_or_duplicate_requests_are_refused():
    s = make(max_model_len=16, num_kv_blocks=8)
    with pytest.raises(InvalidRequestError, match="at most 15 prompt tokens"):
        s.add_request(req("a", 16))
    s.add_request(req("a", 15))
    with pytest.raises(InvalidRequestError, match="already in use"):
        s.add_request(req("a", 3))
    assert len(s.waiting) == 1


def test_waiting_for_features_is_skipped_and_keeps_its_place():
    s = make(max_num_batched_tokens=8, max_num_seqs=2)
    mm = Request("mm", list(range(8)), status=RequestStatus.WAITING_FOR_FEATURES)
    s.add_request(mm)
    for rid, start in (("t", 30), ("u", 40), ("x", 10)):
        s.add_request(req(rid, 4, start=start))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"t": 4, "u": 4}  # mm skipped; x blocked by max_num_seqs
    assert [r.request_id for r in s.waiting] == ["mm", "x"]
    assert s.make_stats().num_waiting_for_features == 1
    mm.status = RequestStatus.WAITING
    s.finish_requests("t", RequestStatus.FINISHED_ABORTED)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"u": 1, "mm": 7}


# ---------------------------------------------------------------------------------------------------
# stop rules
# ---------------------------------------------------------------------------------------------------


def run_alone(s: Scheduler, request: Request, tokens: list[int]):
    """Feed ``tokens`` one per step; return (outputs, finish_reason, stop_reason)."""
    s.add_request(request)
    got, it = [], iter(tokens)
    while request.request_id in s.requests:
        _, res = step(s, {request.request_id: [next(it)]})
        for r in res:
            got += r.new_token_ids
            if r.finished:
                return got, r.finish_reason, r.stop_reason
    raise AssertionError("did not finish")


@pytest.mark.parametrize("params, eos, tokens, expected", [
    (dict(max_tokens=3), None, [5, 6, 7, 8], ([5, 6, 7], "length", None)),
    (dict(), 2, [5, 2, 7], ([5, 2], "stop", None)),
    (dict(ignore_eos=True, max_tokens=3), 2, [5, 2, 7, 8], ([5, 2, 7], "length", None)),
    (dict(min_tokens=3), 2, [2, 2, 2, 9], ([2, 2, 2], "stop", None)),
    (dict(min_tokens=3), 2, [2, 2, 5, 2], ([2, 2, 5, 2], "stop", None)),
    (dict(stop_token_ids=(9,)), 2, [5, 9, 7], ([5, 9], "stop", 9)),
    (dict(stop_token_ids=(9,), min_tokens=2), None, [9, 9], ([9, 9], "stop", 9)),
    (dict(max_tokens=2), 2, [5, 2], ([5, 2], "stop", None)),  # a natural stop on the last token is "stop"
    (dict(max_tokens=None), None, [1] * 20, ([1] * 8, "length", None)),  # 8 prompt + 8 = max_model_len
])
def test_stop_conditions(params, eos, tokens, expected):
    s = make(max_model_len=16, num_kv_blocks=8)
    assert run_alone(s, req("r", 8, eos=eos, **params), tokens) == expected
    assert free_blocks(s) == 7


def test_engine_may_multi_token_append_and_stops_at_the_first_stop():
    s = make()
    s.add_request(req("r", 8, eos=2, max_tokens=10))
    out = s.schedule()
    (res,) = s.update_from_output(out, ModelRunnerOutput({"r": [5, 2, 7]}))
    assert res.new_token_ids == [5, 2] and res.finished and s.requests == {}


def test_stats_report_queues_usage_and_prefix_hits():
    s = make(max_num_batched_tokens=32, max_num_seqs=1)
    s.add_request(req("a", 12))
    s.add_request(req("b", 12))
    step(s)
    stats = s.make_stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(3 / 63)
    s.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    step(s)
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (24, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 24)
    assert s.requests["b"].num_cached_tokens == 8


# ---------------------------------------------------------------------------------------------------
# simulated engine loop
# ---------------------------------------------------------------------------------------------------


def fake_model(context: list[int]) -> int:
    """Next token from the whole context, so a wrong KV block changes the answer."""
    h = 0
    for t in context:
        h = (h * 1_000_003 + t + 1) % 2_305_843_009_213_693_951
    return h % V


class FakeRunner:
    """A model runner that knows only SchedulerOutputs, over a fake KV cache of (token, position)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv = np.full((num_blocks, block_size, 2), -1, dtype=np.int64)
        self.reqs: dict[str, dict] = {}

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for rid in out.finished_req_ids | set(out.preempted_req_ids):
            self.reqs.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.reqs
            self.reqs[new.req_id] = dict(tokens=new.prompt_token_ids + new.output_token_ids,
                                         blocks=list(new.block_ids), computed=new.num_computed_tokens)
        for cached in out.scheduled_cached_reqs:
            state = self.reqs[cached.req_id]
            assert state["computed"] == cached.num_computed_tokens
            state["blocks"] += cached.new_block_ids
        sampled = {}
        # one request at a time, last scheduled first: a block read before another request of the
        # same step wrote it would show up as a wrong token
        for rid, n in reversed(out.num_scheduled_tokens.items()):
            sampled[rid] = self._run(self.reqs[rid], n)
        return sampled

    def _run(self, state: dict, n: int) -> list[int]:
        b, blocks, start = self.block_size, state["blocks"], state["computed"]
        assert 0 not in blocks and len(blocks) >= math.ceil((start + n) / b)
        for pos in range(start, start + n):
            self.kv[blocks[pos // b], pos % b] = (state["tokens"][pos], pos)
        state["computed"] += n
        if state["computed"] < len(state["tokens"]):
            return [V + 1]  # mid-prefill: the scheduler must ignore this
        positions = np.arange(state["computed"])
        cells = self.kv[np.asarray(blocks)[positions // b], positions % b]
        assert (cells[:, 1] == positions).all(), "KV read from a block another request overwrote"
        token = fake_model(cells[:, 0].tolist())
        state["tokens"].append(token)
        return [token]


def reference(prompt: list[int], params: SamplingParams, eos: int | None, max_model_len: int):
    """The same request generated alone, with the stop rules written out independently."""
    tokens, out = list(prompt), []
    while True:
        tok = fake_model(tokens)
        tokens.append(tok)
        out.append(tok)
        if len(out) >= params.min_tokens:
            if (tok == eos and not params.ignore_eos) or tok in params.stop_token_ids:
                return out, "stop"
        if len(tokens) >= max_model_len or (params.max_tokens is not None and len(out) >= params.max_tokens):
            return out, "length"


def check_pool_invariants(s: Scheduler) -> None:
    pool = s.kv_cache_manager.block_pool
    held: dict[int, int] = {}
    for blocks in s.kv_cache_manager.req_to_blocks.values():
        for blk in blocks:
            held[blk.block_id] = held.get(blk.block_id, 0) + 1
    assert all(pool.blocks[i].ref_cnt == n for i, n in held.items())
    assert pool.get_num_free_blocks() + len(held) == pool.num_blocks - 1
    assert set(s.kv_cache_manager.req_to_blocks) == {r.request_id for r in s.running}


def simulate(cfg: SchedulerConfig, specs: list[dict], max_steps: int = 4000) -> Scheduler:
    """Run requests arriving and being aborted at given steps; check every output against a solo run."""
    s = Scheduler(cfg)
    runner = FakeRunner(cfg.num_kv_blocks, cfg.block_size)
    got: dict[str, list[int]] = {sp["id"]: [] for sp in specs}
    reasons: dict[str, str] = {}
    for step_no in range(max_steps):
        for sp in specs:
            if sp["arrival"] == step_no:
                s.add_request(Request(sp["id"], sp["prompt"], sp["params"],
                                      eos_token_ids=() if sp["eos"] is None else (sp["eos"],),
                                      cache_salt=sp["salt"]))
            if sp.get("abort") == step_no and sp["id"] in s.requests:
                s.finish_requests(sp["id"], RequestStatus.FINISHED_ABORTED)
                reasons[sp["id"]] = "abort"
        if not s.has_unfinished_requests() and step_no > max(sp["arrival"] for sp in specs):
            break
        out = s.schedule()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= cfg.max_num_seqs
        if not cfg.enable_chunked_prefill:
            for new in out.scheduled_new_reqs:
                whole = len(new.prompt_token_ids) + len(new.output_token_ids) - new.num_computed_tokens
                assert out.num_scheduled_tokens[new.req_id] == whole
        for res in s.update_from_output(out, ModelRunnerOutput(runner.execute(out))):
            got[res.request_id] += res.new_token_ids
            if res.finished:
                reasons[res.request_id] = res.finish_reason
        check_pool_invariants(s)
    else:
        raise AssertionError("requests did not finish: livelock")
    for sp in specs:
        want, why = reference(sp["prompt"], sp["params"], sp["eos"], cfg.max_model_len)
        if reasons[sp["id"]] == "abort":
            assert got[sp["id"]] == want[:len(got[sp["id"]])]
        else:
            assert (got[sp["id"]], reasons[sp["id"]]) == (want, why), sp["id"]
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == cfg.num_kv_blocks - 1
    return s


def random_specs(rng: random.Random, n: int, max_model_len: int, steps: int, aborts: bool) -> list[dict]:
    prefixes = [[rng.randrange(V) for _ in range(rng.randrange(4, 28))] for _ in range(2)]
    specs = []
    for i in range(n):
        prompt = (rng.choice(prefixes) + [rng.randrange(V) for _ in range(rng.randrange(1, 20))])
        prompt = prompt[:max_model_len - 1]
        max_tokens = rng.randrange(1, 24)
        params = SamplingParams(max_tokens=max_tokens, min_tokens=rng.randrange(0, max_tokens + 1),
                                ignore_eos=rng.random() < 0.2,
                                stop_token_ids=tuple(rng.sample(range(V), rng.randrange(0, 2))))
        specs.append(dict(id=f"r{i}", prompt=prompt, params=params, eos=rng.choice([None, 3]),
                          salt=rng.choice([None, None, "s"]), arrival=rng.randrange(0, steps),
                          abort=rng.randrange(0, 3 * steps) if aborts and rng.random() < 0.2 else None))
    return specs


def test_engine_loop_under_block_pressure_matches_solo_runs():
    """A tiny pool forces preemptions; shared prefixes give prefix hits; all tokens still match."""
    rng = random.Random(7)
    cfg = SchedulerConfig(max_model_len=48, num_kv_blocks=14, block_size=4, max_num_seqs=6,
                          max_num_batched_tokens=24)
    specs = random_specs(rng, 16, cfg.max_model_len, steps=10, aborts=False)
    stats = simulate(cfg, specs).make_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 2, 4, 8]),
       max_model_len=st.integers(8, 64), extra_blocks=st.integers(0, 10), max_num_seqs=st.integers(1, 6),
       chunked=st.booleans(), prefix_caching=st.booleans(), extra_budget=st.integers(0, 40),
       n_requests=st.integers(1, 12))
def test_any_budget_and_pool_gives_every_request_its_solo_tokens(
        seed, block_size, max_model_len, extra_blocks, max_num_seqs, chunked, prefix_caching, extra_budget,
        n_requests):
    floor = max_num_seqs if chunked else max(max_num_seqs, max_model_len)
    cfg = SchedulerConfig(max_model_len=max_model_len, block_size=block_size,
                          num_kv_blocks=math.ceil(max_model_len / block_size) + 1 + extra_blocks,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=floor + extra_budget,
                          enable_chunked_prefill=chunked, enable_prefix_caching=prefix_caching)
    simulate(cfg, random_specs(random.Random(seed), n_requests, max_model_len, steps=4, aborts=True))
