"""The server's pieces without a server: the msgpack protocol, request validation, response shapes."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from fdplug.core.frontend.outputs import Logprob
from fdplug.core.frontend.processor import Delta
from fdplug.core.request import Request
from fdplug.core.scheduler.output import EngineCoreOutput, SchedulerStats
from fdplug.errors import ConfigError, FdplugError, InvalidRequestError, QueueFullError
from fdplug.plugin_api.sampling_params import SamplingParams
from fdplug.plugin_api.scheduled_work import MMPlaceholder
from fdplug.server.api import openai_logprobs as L
from fdplug.server.api import openai_types as T
from fdplug.server.api.jobs import _prompts
from fdplug.server.api.serving import Serving, _merge
from fdplug.server.engine import protocol as P
from tests.serverkit import kernel_honours_custom_slices


def roundtrip(message):
    return P.unpack(P.pack(message))


def test_request_roundtrip():
    params = SamplingParams(n=1, temperature=0.7, top_k=5, seed=3, stop=("a", "bc"), stop_token_ids=(9,),
                            max_tokens=12, logprobs=2, ignore_eos=True)
    req = Request("r1", [1, 2, 3], params, (7, 8), cache_salt="s", mm_positions=[MMPlaceholder(1, 2, "h")])
    [_, [item]] = roundtrip([P.ADD, [P.encode_request(req)]])
    back = P.decode_request(item)
    assert back.request_id == "r1" and back.prompt_token_ids == [1, 2, 3] and back.eos_token_ids == (7, 8)
    assert back.sampling_params == params and back.cache_salt == "s" and back.mm_positions == req.mm_positions
    assert back.arrival_time == req.arrival_time


def test_output_roundtrip_with_numpy_logprobs():
    out = EngineCoreOutput("r", [5], True, "length", None, 3,
                           [(np.array([5, 1]), np.array([-0.1, -2.5], dtype=np.float32), [1, 2])])
    [_, [item], stats] = roundtrip([P.OUTPUTS, [P.encode_output(out)], None])
    back = P.decode_output(item)
    assert back.new_token_ids == [5] and back.finished and back.finish_reason == "length"
    ids, logprobs, ranks = back.new_logprobs[0]
    assert ids == [5, 1] and ranks == [1, 2] and logprobs[1] == pytest.approx(-2.5)
    assert stats is None


def test_stats_and_errors_roundtrip():
    stats = SchedulerStats(1, 2, 0, 0.5, 10, 4, 0.4, 0)
    assert P.decode_stats(roundtrip([P.STATS, P.encode_stats(stats)])[1]) == stats
    err = P.decode_error(roundtrip([P.STARTUP_ERROR, P.encode_error(QueueFullError("full.", fix="wait."))])[1])
    assert type(err) is QueueFullError and err.http_status == 503 and err.fix == "wait."
    bug = P.decode_error(P.encode_error(KeyError("x")))
    assert isinstance(bug, FdplugError) and "KeyError" in bug.message


def test_unpack_rejects_garbage():
    with pytest.raises(ValueError):
        P.unpack(P.pack({"not": "a list"}))  # type: ignore[arg-type]


def test_pickle_never_crosses():
    class Evil:
        pass

    with pytest.raises(TypeError):
        P.pack([P.ADD, [Evil()]])


@pytest.mark.parametrize("body, param, fragment", [
    (b'{"prompt": "x", "max_tokns": 3}', "max_tokns", "unrecognized request argument supplied: max_tokns"),
    (b'{"prompt": "x", "max_tokens": "3"}', "max_tokens", "max_tokens"),
    (b'{"prompt": "x", "n": true}', "n", "n"),
    (b'{"max_tokens": 3}', "prompt", "required"),
    (b'{"prompt": ["a", [1]]}', "prompt", "accepted types"),
    (b"{nope", None, "JSON"),
])
def test_validation_errors_name_the_field(body, param, fragment):
    with pytest.raises(InvalidRequestError) as info:
        T.parse_request(T.CompletionRequest, body)
    assert info.value.param == param and fragment in info.value.message


def test_ints_are_floats_but_strings_are_not():
    req = T.parse_request(T.ChatCompletionRequest, b'{"messages": [], "temperature": 0, "top_p": 1}')
    assert req.temperature == 0.0 and req.max_tokens is None
    assert T.parse_request(T.CompletionRequest, b'{"prompt": "x"}').max_tokens == 16   # OpenAI's default


def test_prompt_forms():
    assert _prompts("a") == ["a"]
    assert _prompts(["a", "b"]) == ["a", "b"]
    assert _prompts([1, 2]) == [{"prompt_token_ids": [1, 2]}]
    assert _prompts([[1], [2, 3]]) == [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2, 3]}]
    with pytest.raises(InvalidRequestError):
        _prompts([])


def _entry(sampled, sampled_lp, sampled_rank, *alts):
    entry = {sampled: Logprob(sampled_lp, sampled_rank, f"t{sampled}")}
    for tid, lp, rank in alts:
        entry.setdefault(tid, Logprob(lp, rank, f"t{tid}"))
    return entry


def test_logprob_shapes():
    entries = [_entry(5, -0.1, 1, (5, -0.1, 1), (6, -2.0, 2)), _entry(9, -3.0, 4, (1, -0.5, 1), (2, -0.9, 2))]
    chat = L.chat_logprobs([5, 9], entries, 2)["content"]
    assert [c["token"] for c in chat] == ["t5", "t9"] and chat[1]["logprob"] == -3.0
    assert [t["token"] for t in chat[1]["top_logprobs"]] == ["t1", "t2"]   # the sampled token is not top-2
    assert chat[0]["bytes"] == list(b"t5")
    comp = L.completion_logprobs([5, 9], entries, 1)
    assert comp["tokens"] == ["t5", "t9"] and comp["token_logprobs"] == [-0.1, -3.0]
    assert comp["top_logprobs"] == [{"t5": -0.1}, {"t1": -0.5}] and comp["text_offset"] == [0, 2]


def test_merge_coalesces_per_sequence():
    d = [Delta("a", 0, "x", [1], None, None, None), Delta("a", 1, "p", [7], None, None, None),
         Delta("a", 0, "y", [2], None, "length", None)]
    merged = _merge(d)
    assert merged[("a", 0)].text == "xy" and merged[("a", 0)].token_ids == [1, 2]
    assert merged[("a", 0)].finish_reason == "length" and merged[("a", 1)].text == "p"
    assert d[0].text == "x"                                # inputs untouched


def test_merge_keeps_the_typed_error_of_a_failed_step():
    failure = FdplugError("feature fetch failed")
    d = [Delta("a", 0, "x", [1], None, None, None), Delta("a", 0, "", [], None, "error", "fetch", failure)]
    assert _merge(d)[("a", 0)].error is failure
    assert _merge([d[1], Delta("b", 0, "z", [3], None, None, None)])[("a", 0)].error is failure


def test_stream_interval_holds_tokens_between_the_first_and_the_finish():
    serving = Serving(client=None, stream_interval=3)
    held, started, key = {}, set(), ("a", 0)

    def step(token: int, finish: str | None = None):
        out = serving._hold(key, Delta("a", 0, f"t{token}", [token], None, finish, None), held, started)
        return None if out is None else out.token_ids

    assert step(1) == [1]                             # the first token goes out at once (TTFT)
    assert [step(2), step(3), step(4)] == [None, None, [2, 3, 4]]
    assert [step(5), step(6, "length")] == [None, [5, 6]]   # the finish flushes what is held
    assert held == {}


# -- event loop choice ----------------------------------------------------------------------------


def test_event_loop_choice(monkeypatch):
    import uvloop

    from fdplug.server.api.launcher import event_loop_factory

    monkeypatch.setenv("FDPLUG_EVENT_LOOP", "asyncio")
    assert event_loop_factory() is None
    for choice in ("auto", "uvloop"):
        monkeypatch.setenv("FDPLUG_EVENT_LOOP", choice)
        assert event_loop_factory() is uvloop.new_event_loop
    monkeypatch.setitem(sys.modules, "uvloop", None)       # as if it were not installed
    monkeypatch.setenv("FDPLUG_EVENT_LOOP", "auto")
    assert event_loop_factory() is None
    monkeypatch.setenv("FDPLUG_EVENT_LOOP", "uvloop")
    with pytest.raises(ConfigError, match="pip install uvloop"):
        event_loop_factory()


def test_freeze_startup_heap_keeps_collecting_new_garbage():
    code = """
import gc
from fdplug.core.heap import freeze_startup_heap
survivors = [[i] for i in range(50_000)]
frozen = freeze_startup_heap()
class Cycle: pass
a, b = Cycle(), Cycle(); a.other, b.other = b, a; del a, b
print(frozen, gc.collect(), gc.get_freeze_count() == frozen)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    frozen, collected, unchanged = out.stdout.split()
    assert int(frozen) >= 50_000 and int(collected) >= 2 and unchanged == "True"



def test_an_offline_llm_freezes_the_heap_once_a_process():
    code = """
import gc
from fdplug.core.heap import freeze_startup_heap_once
first = freeze_startup_heap_once()
count = gc.get_freeze_count()
print(first, freeze_startup_heap_once(), gc.get_freeze_count() == count)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    first, second, unchanged = out.stdout.split()
    assert int(first) > 0 and int(second) == 0 and unchanged == "True"

SLICE_PROBE = """
import os, sys, threading
from fdplug.server.engine.os_timeslice import current_slice_ns, shorten_scheduler_slice
nice, policy = os.nice(3), os.sched_getscheduler(0)
default = current_slice_ns()
got, why = shorten_scheduler_slice(int(sys.argv[1]))
seen = []
thread = threading.Thread(target=lambda: seen.append(current_slice_ns()))
thread.start(); thread.join()
kept = (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)) == (nice, policy)
print(default, got, seen[0], kept, why)
"""


def test_engine_scheduler_slice_is_set_kept_nice_and_inherited_by_later_threads():
    out = subprocess.run([sys.executable, "-c", SLICE_PROBE, "250"], capture_output=True, text=True, timeout=60,
                         check=True).stdout.split(maxsplit=4)
    default, got, in_thread, kept, why = out
    assert kept == "True"          # sched_setattr sets the nice value and the policy too: both kept
    if kernel_honours_custom_slices():
        assert (got, in_thread) == ("250000", "250000") and default != "250000", out
        assert why.startswith("set so the engine's threads preempt")
    else:                                         # nothing pretended: the kernel's slice, and why
        assert got == default and why.startswith("unchanged"), out


def test_engine_scheduler_slice_zero_keeps_the_kernel_default():
    default, got, in_thread, *_ = subprocess.run([sys.executable, "-c", SLICE_PROBE, "0"], capture_output=True,
                                                 text=True, timeout=60, check=True).stdout.split(maxsplit=4)
    assert default == got == in_thread


@pytest.mark.parametrize("raw", ["50", "100001", "-1", "soon"])
def test_engine_slice_variable_rejects_what_the_kernel_would_clamp(monkeypatch, raw):
    from fdplug.core.config import env

    monkeypatch.setenv("FDPLUG_ENGINE_SLICE_US", raw)
    with pytest.raises(ConfigError, match="FDPLUG_ENGINE_SLICE_US"):
        env("FDPLUG_ENGINE_SLICE_US")
