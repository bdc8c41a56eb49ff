"""`fdplug serve --data-parallel-size 2 --data-parallel-backend ray`: engines placed by a real local Ray.

The same answers as one engine (the golden fixture's greedy tokens), over CURVE-encrypted TCP
sockets; an engine killed mid-request fails its own request only, and Ray brings it back: a new
engine process on the same rank, serving again. Expert parallel on Ray engines (the group meeting
on rank 0's node) gives transformers' greedy tokens on a MoE fixture, from either rank.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal

import httpx
import numpy as np
import pytest

pytest.importorskip("ray", reason="the ray extra: pip install -e '.[test]' installs it")

from tests.conftest import golden  # noqa: E402
from tests.serverkit import Server, wait_until  # noqa: E402
from tests.test_moe_golden import greedy, servable  # noqa: E402
from tests.test_server_dp import golden_model, per_engine  # noqa: E402, F401  (a fixture)


def test_ray_engines_answer_like_one_engine_and_come_back_after_a_kill(golden_model, tmp_path):  # noqa: F811 (the imported fixture)
    # room for a stream that outlasts the kill: 120 tokens of this tiny model had once all been made
    # (and buffered by the client) before the SIGKILL landed, in a CI run. Plain RoPE: a longer
    # table leaves the first positions' logits as they are.
    model = tmp_path / "llama-2k"
    shutil.copytree(golden_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    server = Server(["--model", str(model), "--served-model-name", "golden", "--max-model-len", "2048",
                     "--num-kv-blocks", "512", "--data-parallel-size", "2", "--data-parallel-backend", "ray"],
                    tmp_path / "ray.log", RAY_AUTH_MODE="disabled").wait_ready(180)
    try:
        log = server.log()
        assert re.search(r"Ray local: 2 engines of 1 CPUs each", log), log
        assert "tcp://127.0.0.1:" not in log          # addresses (and keys) stay out of the log
        (sequence, _), (logits, _) = golden("llama")
        client = server.openai()
        for k in (4, 8, 11):
            reply = client.completions.create(model="golden", prompt=sequence[:k], max_tokens=1, temperature=0,
                                              logprobs=1, extra_body={"ignore_eos": True})
            row = logits[k - 1].astype(np.float64)
            want = row - row.max() - np.log(np.exp(row - row.max()).sum())
            assert abs(reply.choices[0].logprobs.token_logprobs[0] - want.max()) <= 1e-4, k

        engines = httpx.get(server.url + "/health").json()["engines"]
        stream = client.completions.create(model="golden", prompt=[1, 2, 3], max_tokens=2000, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        busy = [e for e in httpx.get(server.url + "/health").json()["engines"] if e["in_flight"]]
        assert len(busy) == 1
        os.kill(busy[0]["pid"], signal.SIGKILL)
        with pytest.raises(Exception):   # noqa: B017 (the openai client's stream error)
            list(chunks)

        def back() -> bool:
            now = httpx.get(server.url + "/health").json()["engines"]
            return all(e["alive"] for e in now) and now[busy[0]["rank"]]["pid"] != busy[0]["pid"]

        wait_until(back, 120, 0.5, what="the killed engine restarted by Ray")
        assert [e["rank"] for e in httpx.get(server.url + "/health").json()["engines"]] == [0, 1]
        assert engines[1 - busy[0]["rank"]]["pid"] == httpx.get(server.url + "/health").json()["engines"][
            1 - busy[0]["rank"]]["pid"]                # the other engine was never touched
        for _ in range(4):                             # both serve again
            client.completions.create(model="golden", prompt=[7, 8, 9], max_tokens=2, temperature=0)
        assert per_engine(server, "fdplug:engine_up") == {0: 1.0, 1: 1.0}
    finally:
        assert server.stop(timeout=60) == 0, server.log()


def test_expert_parallel_on_ray_engines_gives_transformers_greedy_tokens(tmp_path):
    from fdplug.core.model.text.tokenizer import Tokenizer

    model = servable("qwen2_moe", tmp_path)
    server = Server(["--model", model, "--served-model-name", "golden", "--max-model-len", "64",
                     "--num-kv-blocks", "64", "--expert-parallel-size", "2", "--data-parallel-backend", "ray"],
                    tmp_path / "ray-ep.log", RAY_AUTH_MODE="disabled").wait_ready(180)
    try:
        tokenizer, client = Tokenizer.from_dir(model), server.openai()
        for run in greedy("qwen2_moe"):
            for rank in (0, 1):
                reply = client.completions.create(model="golden", prompt=run["prompt"], max_tokens=len(run["tokens"]),
                                                  temperature=0, logprobs=1, extra_body={"ignore_eos": True},
                                                  extra_headers={"X-Data-Parallel-Rank": str(rank)})
                assert reply.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t in run["tokens"]], rank
        # the actors' output reaches the log when Ray forwards it, and Ray folds lines that differ only in
        # numbers: whichever rank's line comes first stands for both (rank 0 owns experts 0..3, rank 1 4..7)
        wait_until(lambda: "rank 0 of 2: experts 0..3 of 8" in server.log()
                   or "rank 1 of 2: experts 4..7 of 8" in server.log(), 30, 0.2, what="a rank's expert shard logged")
        assert "Ray local: 2 engines" in server.log()
    finally:
        assert server.stop() == 0, server.log()


def test_engines_reserve_their_device_and_know_its_index_on_their_node():
    from fdplug.server.engine.ray_engines import device_indices, engine_bundles

    assert engine_bundles(2, 8, "cpu") == ([{"CPU": 4}, {"CPU": 4}], 4)
    assert engine_bundles(3, 2, "cpu") == ([{"CPU": 1}] * 3, 1)
    assert engine_bundles(2, 64, "cuda") == ([{"CPU": 1, "GPU": 1}] * 2, 1)
    assert engine_bundles(2, 64, "xpu") == ([{"CPU": 1, "XPU": 1}] * 2, 1)
    nodes = ["a", "b", "a", "a", "b"]
    assert device_indices(nodes, "xpu") == [0, 0, 1, 2, 1]       # the ordinal among its node's bundles
    assert device_indices(nodes, "cuda") == [0] * 5              # Ray makes the engine's one GPU visible
