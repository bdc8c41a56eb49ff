"""`fdplug serve --expert-parallel-size 2`: two engines holding half of the experts each, in lockstep.

On the MoE golden fixtures (tiny random checkpoints with transformers' greedy continuations) every
run gets transformers' tokens on either rank, with both ranks busy at once and with one of them
idle (its experts still serve the other's tokens: every step of one rank is a round the other
joins). A rank idle for hundreds of the other's steps never holds it up; a request whose steps fail
on one rank fails alone (the engine's fault containment re-runs parts of the step: rounds the other
rank joins) while both ranks' other requests finish as if it had not been there; a rank that dies
stops the group, and every request in flight ends with an error instead of hanging. Sizes that
cannot work are refused before anything loads.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fdplug.core.model.text.tokenizer import Tokenizer
from fdplug.errors import ConfigError
from fdplug.server.api.launcher import serve
from fdplug.server.api.server_settings import ServerSettings
from tests.conftest import write_test_model
from tests.serverkit import Server, alive, wait_until
from tests.test_moe_golden import greedy, servable
from tests.test_moe_models import QWEN2_MOE
from tests.test_server_dp import per_engine
from tests.test_step_recovery import AFTER, MARKER, faulty_runner_env

FIXTURES = ("qwen3_moe", "ernie4_5_moe")    # top-3 softmax routing; selection bias and shared experts


def start(model, log, *extra: str, **env: str) -> Server:
    return Server(["--model", str(model), "--served-model-name", "golden", "--num-kv-blocks", "64",
                   "--expert-parallel-size", "2", *extra], log, **env).wait_ready(120)


@pytest.mark.parametrize("name", FIXTURES)
def test_either_rank_gives_transformers_greedy_tokens_busy_or_alone(name, tmp_path):
    model = servable(name, tmp_path)
    server = start(model, tmp_path / "ep.log", "--max-model-len", "64")
    try:
        runs, tokenizer, client = greedy(name), Tokenizer.from_dir(model), server.openai()

        def ask(job):
            run, rank = job
            reply = client.completions.create(model="golden", prompt=run["prompt"], max_tokens=len(run["tokens"]),
                                              temperature=0, logprobs=1, extra_body={"ignore_eos": True},
                                              extra_headers={"X-Data-Parallel-Rank": str(rank)})
            return reply.choices[0].logprobs.tokens

        jobs = [(run, rank) for run in runs for rank in (0, 1)]
        with ThreadPoolExecutor(len(jobs)) as pool:             # both ranks with work in the same rounds
            together = list(pool.map(ask, jobs))
        alone = [ask((run, 1)) for run in runs]                  # rank 0 idle: its experts still serve
        for (run, _), pieces in zip(jobs + [(run, 1) for run in runs], together + alone):
            assert pieces == [tokenizer.decode([t]) for t in run["tokens"]]
        assert per_engine(server, "fdplug:engine_requests_total") == {0: len(runs), 1: 2 * len(runs)}
        log = server.log()
        assert "rank 0 of 2: experts 0..3 of 8" in log and "rank 1 of 2: experts 4..7 of 8" in log, log
    finally:
        assert server.stop() == 0, server.log()


def test_a_rank_idle_for_hundreds_of_steps_never_holds_the_other_up(tmp_path):
    model = write_test_model(tmp_path / "moe", **QWEN2_MOE)
    server = start(model, tmp_path / "ep.log", "--max-model-len", "512", FD_EP_BATCHED_TOKEN_TIMEOUT="0")
    try:
        client = server.openai(timeout=30.0)       # no request may wait on the idle rank
        began = time.monotonic()
        for i in range(20):
            reply = client.completions.create(model="golden", prompt=[3 + i, 4, 5], max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True},
                                              extra_headers={"X-Data-Parallel-Rank": "0"})
            assert reply.choices[0].finish_reason == "length"
        long_one = client.completions.create(model="golden", prompt=[7, 8], max_tokens=400, temperature=0,
                                             extra_body={"ignore_eos": True},
                                             extra_headers={"X-Data-Parallel-Rank": "0"})
        assert long_one.usage.completion_tokens == 400
        assert time.monotonic() - began < 120
        assert per_engine(server, "fdplug:engine_requests_total") == {0: 21.0}
        reply = client.completions.create(model="golden", prompt=[9, 9], max_tokens=4, temperature=0,
                                          extra_headers={"X-Data-Parallel-Rank": "1"})
        assert reply.usage.completion_tokens >= 1                # and the idle one serves when asked
    finally:
        assert server.stop() == 0, server.log()


def test_a_failing_request_on_one_rank_fails_alone_and_both_ranks_keep_their_tokens(tmp_path):
    import openai

    env = faulty_runner_env(tmp_path / "site", mode="raise", marker=MARKER, after=AFTER)
    model = write_test_model(tmp_path / "moe", **QWEN2_MOE)
    server = start(model, tmp_path / "ep.log", "--max-model-len", "128", "--runner", "faulty", **env)
    prompts = [[10 + i, 20 + 3 * i, 30, 40 - i] for i in range(4)]

    async def run(with_culprit: bool):
        client = server.async_openai()
        ask = [client.completions.create(model="golden", prompt=p, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True},
                                         extra_headers={"X-Data-Parallel-Rank": str(i % 2)})
               for i, p in enumerate(prompts)]
        if with_culprit:
            ask.append(client.completions.create(model="golden", prompt=[MARKER, 3, 8, 1], max_tokens=24,
                                                 temperature=0, extra_body={"ignore_eos": True},
                                                 extra_headers={"X-Data-Parallel-Rank": "0"}))
        return await asyncio.gather(*ask, return_exceptions=True)

    try:
        alone = [r.choices[0].text for r in asyncio.run(run(False))]
        *together, culprit = asyncio.run(run(True))
        assert isinstance(culprit, openai.InternalServerError), culprit
        assert [r.choices[0].text for r in together] == alone
        assert [e["alive"] for e in httpx.get(server.url + "/health").json()["engines"]] == [True, True]
    finally:
        assert server.stop() == 0, server.log()


def test_a_killed_rank_stops_the_group_and_every_request_ends(tmp_path):
    model = write_test_model(tmp_path / "moe", **QWEN2_MOE)
    server = start(model, tmp_path / "ep.log", "--max-model-len", "2048", "--num-kv-blocks", "600")
    client = server.openai(timeout=30.0)
    try:
        pids = [e["pid"] for e in httpx.get(server.url + "/health").json()["engines"]]
        streams = []
        for rank in (0, 1):
            stream = client.completions.create(model="golden", prompt=[rank + 1, 4], max_tokens=2000, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True},
                                               extra_headers={"X-Data-Parallel-Rank": str(rank)})
            chunks = iter(stream)
            streams.append((chunks, next(chunks)))
        os.kill(pids[1], signal.SIGKILL)
        ended = time.monotonic()
        for chunks, _ in streams:
            with pytest.raises(Exception):     # noqa: B017 -- the openai client's stream error, whichever
                for _ in chunks:
                    pass
        assert time.monotonic() - ended < 30
        wait_until(lambda: not alive(pids[0]) and not alive(pids[1]), 20, what="both engines gone")
        assert server.proc.wait(20) == 1       # the last engine gone: the server stops with status 1
        assert "ParallelGroupError" in server.log() or "expert-parallel group failed" in server.log(), server.log()
    finally:
        if server.proc.poll() is None:
            server.stop()


def test_sizes_that_cannot_work_are_refused_before_loading(tmp_path, test_model_dir):
    moe = servable("qwen2_moe", tmp_path)
    cases = [({"expert_parallel_size": 3}, moe, "8 experts do not split evenly over --expert-parallel-size 3"),
             ({"expert_parallel_size": 2}, test_model_dir, "has none"),
             ({"expert_parallel_size": 2, "data_parallel_size": 3}, moe, "the expert-parallel ranks are the data")]
    for settings, model, why in cases:
        with pytest.raises(ConfigError, match=why):
            serve(ServerSettings(port=0, **settings), {"model": str(model)})
