"""`fdplug serve --data-parallel-size 2`: two engine processes behind one API, driven over HTTP.

On the golden fixture (a tiny random Llama with transformers' logits): every prefix gets
transformers' greedy token whichever engine serves it; requests spread over both engines; a
request whose prefix one engine holds goes there even when it is the busier one (within the
router's slack); killing one engine fails only its own requests, ``/health`` says so, and the other
engine keeps serving.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from fdplug.demo.random_model import ensure_random_model
from tests.conftest import GOLDEN, golden
from tests.serverkit import Server, alive, wait_until

PREFIXES = (3, 5, 7, 9, 11, 12)


@pytest.fixture(scope="module")
def golden_model(tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("golden") / "llama"
    shutil.copytree(GOLDEN / "llama", model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_random_model() / name, model / name)
    return model


def start(model: Path, log: Path, max_model_len: int = 128) -> Server:
    return Server(["--model", str(model), "--served-model-name", "golden", "--max-model-len", str(max_model_len),
                   "--num-kv-blocks", "256", "--data-parallel-size", "2"], log).wait_ready(120)


def per_engine(server: Server, name: str) -> dict[int, float]:
    text = httpx.get(server.url + "/metrics", timeout=5.0).text
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(rf'^{re.escape(name)}\{{engine="(\d+)",model_name="golden"\}} (\S+)$', text, re.M)}


def test_greedy_tokens_match_transformers_on_both_engines_and_requests_spread(golden_model, tmp_path):
    server = start(golden_model, tmp_path / "dp.log")
    try:
        health = httpx.get(server.url + "/health").json()
        assert health["status"] == "ok" and [e["rank"] for e in health["engines"]] == [0, 1]
        (sequence, _), (logits, _) = golden("llama")
        client = server.openai()

        def ask(k: int):
            return client.completions.create(model="golden", prompt=sequence[:k], max_tokens=1, temperature=0,
                                             logprobs=1, extra_body={"ignore_eos": True})

        with ThreadPoolExecutor(len(PREFIXES)) as pool:
            replies = list(pool.map(ask, PREFIXES))
        from fdplug.core.model.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(golden_model)
        for k, reply in zip(PREFIXES, replies):
            row = logits[k - 1].astype(np.float64)
            want = row - row.max() - np.log(np.exp(row - row.max()).sum())
            best = int(np.argmax(want))
            assert reply.choices[0].text == tokenizer.decode([best]), k
            assert abs(reply.choices[0].logprobs.token_logprobs[0] - want[best]) <= 1e-4, k
        routed = per_engine(server, "fdplug:engine_requests_total")
        assert sum(routed.values()) == len(PREFIXES) and min(routed.values()) >= 1, routed
        for _ in range(2):                                   # vLLM's header: an explicit engine wins
            ask_one = client.completions.with_raw_response.create(
                model="golden", prompt=[1, 2], max_tokens=1, extra_headers={"X-Data-Parallel-Rank": "1"})
            assert ask_one.status_code == 200
        assert per_engine(server, "fdplug:engine_requests_total")[1] == routed[1] + 2
        for bad, why in (("2", "is not one of this server's engines (0..1)"), ("x", "must be an engine's rank")):
            reply = httpx.post(server.url + "/v1/completions", headers={"X-Data-Parallel-Rank": bad},
                               json={"model": "golden", "prompt": [1, 2], "max_tokens": 1})
            assert reply.status_code == 400 and why in reply.json()["error"]["message"], reply.text
            assert reply.json()["error"]["param"] == "X-Data-Parallel-Rank"
    finally:
        assert server.stop() == 0, server.log()


def test_a_cached_prefix_draws_its_request_and_a_dead_engine_fails_only_its_own(test_model_dir, tmp_path):
    server = start(test_model_dir, tmp_path / "dp.log", max_model_len=2048)   # long streams: alive when killed
    try:
        client = server.openai()
        shared = list(range(5, 5 + 48))                      # three 16-token blocks
        client.completions.create(model="golden", prompt=shared, max_tokens=1, temperature=0)
        assert per_engine(server, "fdplug:engine_requests_total") == {0: 1.0}     # both idle: rank 0
        with client.completions.create(model="golden", prompt=[1, 2, 3], max_tokens=200, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}) as long_one:
            next(iter(long_one))                             # running on engine 0 (both idle: rank 0)
            hits_before = server.metrics()["fdplug:prefix_cache_hits_total"]
            client.completions.create(model="golden", prompt=shared + [7], max_tokens=1, temperature=0)
            routed = per_engine(server, "fdplug:engine_requests_total")
            assert routed == {0: 3.0}, routed                # the busier engine, which holds the prefix
            wait_until(lambda: server.metrics()["fdplug:prefix_cache_hits_total"] >= hits_before + 48, 10,
                       what="the prefix cache hit on engine 0")
            for _ in long_one:
                pass

        pids = [e["pid"] for e in httpx.get(server.url + "/health").json()["engines"]]
        streams = []
        for p in (1, 2):                                     # one long stream on each engine, in rank order
            stream = client.completions.create(model="golden", prompt=[p, 4, 5], max_tokens=2000, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            chunks = iter(stream)
            streams.append((chunks, [next(chunks)]))
        assert [e["in_flight"] for e in httpx.get(server.url + "/health").json()["engines"]] == [1, 1]
        os.kill(pids[1], signal.SIGKILL)
        outcomes = []
        for chunks, got in streams:
            try:
                got += list(chunks)
                outcomes.append(sum(len(c.choices[0].text) > 0 for c in got))
            except Exception as exc:  # noqa: BLE001 (the openai client's stream error)
                outcomes.append(type(exc).__name__)
        assert isinstance(outcomes[0], int) and outcomes[0] > 0 and not isinstance(outcomes[1], int), outcomes
        wait_until(lambda: not alive(pids[1]), 10, what="engine 1 reaped")
        health = httpx.get(server.url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert [e["alive"] for e in health.json()["engines"]] == [True, False]
        assert server.metrics()["fdplug:engine_alive"] == 1
        for _ in range(3):                                   # the survivor takes everything now
            reply = client.completions.create(model="golden", prompt=[9, 8, 7], max_tokens=2, temperature=0)
            assert reply.choices[0].finish_reason == "length"
        assert per_engine(server, "fdplug:engine_up") == {0: 1.0, 1: 0.0}
    finally:
        assert server.stop() == 0, server.log()


def test_fan_out_and_client_disconnects_are_handled_on_the_engine_that_has_them(test_model_dir, tmp_path):
    """``n=3`` goes to one engine as three sequences; a client that hangs up mid-stream frees its
    request there (both engines end with nothing in flight, their KV caches empty)."""
    server = start(test_model_dir, tmp_path / "dp.log", max_model_len=2048)
    try:
        client = server.openai()
        reply = client.completions.create(model="golden", prompt=[4, 5, 6], max_tokens=4, n=3, temperature=1.0,
                                          seed=7)
        assert len(reply.choices) == 3 and sorted(c.index for c in reply.choices) == [0, 1, 2]
        for p in (1, 2):                                     # streams dropped after their first chunk
            with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                              json={"model": "golden", "prompt": [p, 3], "max_tokens": 2000, "stream": True,
                                    "ignore_eos": True}) as response:
                next(response.iter_lines())
        wait_until(lambda: all(e["in_flight"] == 0 for e in httpx.get(server.url + "/health").json()["engines"]),
                   20, what="both engines idle after the disconnects")
        wait_until(lambda: server.metrics()["fdplug:kv_cache_usage_perc"] == 0.0, 20,
                   what="every KV block free again")
        assert sum(per_engine(server, "fdplug:engine_requests_total").values()) == 3
    finally:
        assert server.stop() == 0, server.log()
