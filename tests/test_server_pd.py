"""`fdplug serve --role prefill` and `--role decode`: a request prefilled by one server, decoded by another.

Driven over HTTP as `fdplug router` does, then through the router: the prefill instance runs the
request with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}`` and answers with
where to pull its KV (signed: both share ``FDPLUG_PD_SECRET``); the decode instance takes the
original request with those params, pulls the KV from the prefill engine process (the default
``shm`` connector: a shared-memory arena on one machine) and streams the rest: the same greedy text as one
instance, streamed or not, text and multimodal (only the prefill instance may read the feature
files: the decode instance never needs them), with prefix hits on both sides. Afterwards neither
instance runs anything and neither holds KV blocks. Bad params are a 400 naming the field, and an
instance without ``--role`` refuses them.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import fdplug
from fdplug.core.frontend.llm import LLM
from fdplug.plugin_api.sampling_params import SamplingParams
from tests.conftest import write_test_model
from tests.serverkit import Server, start_router, wait_until

PROMPTS = [[5, 9, 2], [11, 3, 8, 21, 34, 55, 89, 14, 23, 37, 60, 97, 57, 54, 11, 65, 76, 41, 17, 58], [7] * 37]
TOKENS = 12
ARGS = ["--max-model-len", "128", "--num-kv-blocks", "64", "--served-model-name", "m"]


SECRET = {"FDPLUG_PD_SECRET": "shared by the PD pair"}


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    model = str(write_test_model(tmp_path_factory.mktemp("pd") / "m"))
    logs, features = tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("features")
    prefill = Server(["--model", model, "--role", "prefill", "--allowed-feature-path", str(features), *ARGS],
                     logs / "prefill.log", **SECRET).wait_ready()
    decode = Server(["--model", model, "--role", "decode", *ARGS], logs / "decode.log", **SECRET).wait_ready()
    prefill.features = features
    yield model, prefill, decode
    assert decode.stop() == 0, decode.log()
    assert prefill.stop() == 0, prefill.log()


def relay(prefill: Server, decode: Server, prompt: list[int], stream: bool) -> str:
    first = httpx.post(prefill.url + "/v1/completions", timeout=60, json={
        "model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert first.status_code == 200, first.text
    body = {"model": "m", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "kv_transfer_params": first.json()["kv_transfer_params"], "stream": stream}
    if not stream:
        reply = httpx.post(decode.url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]
    client = decode.openai()
    return "".join(c.choices[0].text for c in client.completions.create(
        **{k: v for k, v in body.items() if k in ("model", "prompt", "max_tokens", "temperature", "stream")},
        extra_body={"ignore_eos": True, "kv_transfer_params": body["kv_transfer_params"]}))


def test_prefill_then_decode_gives_one_instances_text(pd):
    model, prefill, decode = pd
    want = [o.outputs[0].text for o in LLM(model, max_model_len=128, num_kv_blocks=64).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True),
        use_tqdm=False)]
    for stream in (False, True):
        assert [relay(prefill, decode, p, stream) for p in PROMPTS] == want
    for server in (prefill, decode):          # nothing left running, no block held for a pull; prefix hits
        wait_until(lambda s=server: s.metrics()["fdplug:kv_cache_usage_perc"] == 0.0, 10, what="KV blocks released")
        assert server.metrics()["fdplug:num_requests_running"] == 0
        # the engine's stats reach /metrics with its next report: wait for it, as for the usage above
        wait_until(lambda s=server: s.metrics()["fdplug:prefix_cache_hits_total"] > 0, 10,
                   what=f"prefix cache hits on {server.url}")


def test_bad_params_are_a_400_naming_the_field(pd, tmp_path):
    _, prefill, decode = pd
    good = prefill_answer(prefill, [5, 9, 2])
    evil = {**good, "conn": {**good["conn"], "addr": "tcp://10.0.0.1:22"}}
    cases = [(prefill, [5, 9, 2], {"do_remote_decode": "yes"}, "must be {\"do_remote_decode\": true}"),
             (decode, [5, 9, 2], {**good, "first_token": 10 ** 9}, "out of range"),
             (decode, [5, 9, 2], {k: v for k, v in good.items() if k != "prompt_digest"}, "must hold connector"),
             (decode, [5, 9, 2], evil, "not signed with this decode instance's FDPLUG_PD_SECRET"),
             (decode, [5, 9, 3], good, "describe another prompt")]
    for server, prompt, params, why in cases:
        reply = httpx.post(server.url + "/v1/completions", timeout=30, json={
            "model": "m", "prompt": prompt, "max_tokens": 2, "kv_transfer_params": params})
        assert reply.status_code == 400 and why in reply.json()["error"]["message"], reply.text
        assert reply.json()["error"]["param"] == "kv_transfer_params"
    plain = Server(["--model", pd[0], *ARGS], tmp_path / "plain.log").wait_ready()
    try:
        reply = httpx.post(plain.url + "/v1/completions", timeout=30, json={
            "model": "m", "prompt": [5, 9, 2], "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}})
        assert reply.status_code == 400 and "only taken by a prefill or decode instance" in reply.text
    finally:
        assert plain.stop() == 0


@pytest.fixture(scope="module")
def router(pd, tmp_path_factory):
    _, prefill, decode = pd
    router = start_router(prefill.url, decode.url, tmp_path_factory.mktemp("router") / "router.log")
    yield router.url
    assert router.stop() == 0


def test_the_router_serves_like_one_instance(pd, router):
    import openai

    model, _, _ = pd
    single = LLM(model, max_model_len=128, num_kv_blocks=64)
    want = [o.outputs[0].text for o in single.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True),
        use_tqdm=False)]
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0, timeout=60)
    for prompt, expected in zip(PROMPTS, want):
        reply = client.completions.create(model="m", prompt=prompt, max_tokens=TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.choices[0].text == expected and reply.usage.completion_tokens == TOKENS
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="m", prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True}))
        assert streamed == expected
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
    alone = single.chat([{"role": "user", "content": "hello"}],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert chat.choices[0].message.content == alone[0].outputs[0].text
    for bad, param in (({"n": 2}, "n"), ({"kv_transfer_params": {}}, "kv_transfer_params")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="m", prompt=[1, 2], max_tokens=2, extra_body=bad)
        assert caught.value.body["param"] == param
    plain = pd[2].openai().completions.create(model="m", prompt=PROMPTS[2], max_tokens=4, temperature=0, logprobs=2)
    relayed = client.completions.create(model="m", prompt=PROMPTS[2], max_tokens=4, temperature=0, logprobs=2)
    assert relayed.choices[0].logprobs.tokens == plain.choices[0].logprobs.tokens          # the first one too
    assert relayed.choices[0].logprobs.token_logprobs == pytest.approx(plain.choices[0].logprobs.token_logprobs,
                                                                       abs=1e-4)
    assert relayed.choices[0].logprobs.top_logprobs[0].keys() == plain.choices[0].logprobs.top_logprobs[0].keys()
    health = httpx.get(router + "/health").json()
    assert health["status"] == "ok" and health["prefill"][0]["alive"] and health["decode"][0]["alive"]
    assert httpx.get(router + "/version").json()["api_version"] == fdplug.API_VERSION
    assert httpx.get(router + "/v1/models/m").json()["id"] == "m"
    missing = httpx.get(router + "/v1/models/gpt%209")
    assert missing.status_code == 404 and "'gpt 9'" in missing.json()["error"]["message"]
    metrics = httpx.get(router + "/metrics").text
    assert 'fdplug_router:requests_total{stage="decode",status="200"} 8.0' in metrics, metrics
    assert 'fdplug_router:requests_total{stage="router",status="400"} 2.0' in metrics
    assert 'fdplug_router:in_flight{role="decode",url="' in metrics


def prefill_answer(prefill: Server, prompt: list[int]) -> dict:
    reply = httpx.post(prefill.url + "/v1/completions", timeout=60, json={
        "model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert reply.status_code == 200, reply.text
    return reply.json()["kv_transfer_params"]


def test_multimodal_through_the_router_reads_features_on_the_prefill_side_only(pd, router):
    """Only the prefill instance may read the feature files (--allowed-feature-path): the decode
    instance gets every prompt token's KV, never the features, and gives one instance's text; the
    same images again (by content, and by uuid) hit both sides' prefix caches."""
    import io

    import numpy as np
    import openai

    model, prefill, decode = pd
    for name, seed, rows in (("dog.npy", 3, 6), ("cat.npy", 4, 4)):
        buf = io.BytesIO()
        np.save(buf, np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32))
        (prefill.features / name).write_bytes(buf.getvalue())
    parts = [{"type": "image_feature", "image_feature": {"url": (prefill.features / "dog.npy").as_uri(),
                                                         "grid_thw": [1, 4, 6]}},
             {"type": "image_feature", "image_feature": {"url": (prefill.features / "cat.npy").as_uri(),
                                                         "grid_thw": [1, 4, 4], "uuid": "cat-1"}}]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "describe"}]}]
    llm = LLM(model, max_model_len=128, num_kv_blocks=64, allowed_feature_paths=(str(prefill.features),))
    want = llm.generate(llm.chat_prompt(messages), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0, timeout=60)
    hits = {server.url: server.metrics()["fdplug:prefix_cache_hits_total"] for server in (prefill, decode)}
    for _ in range(2):
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == want
    for server in (prefill, decode):
        wait_until(lambda s=server: s.metrics()["fdplug:prefix_cache_hits_total"] > hits[s.url], 5,
                   what=f"prefix hits on {server.url}")
    with pytest.raises(openai.BadRequestError, match="allowed"):     # the decode instance may read none of them
        decode.openai().chat.completions.create(model="m", messages=messages, max_tokens=2)


def test_faults_end_each_request_within_its_timeout_and_free_every_block(pd, tmp_path):
    """With a third party's connector that sends a layer per second (``tests/slow_kv_plugin.py``),
    and no FDPLUG_PD_SECRET: the decode instances name the prefill instance's KV endpoint
    (``--kv-port`` there, ``--kv-peers`` here), and a conn naming any other address is a 400.
    A decode instance killed before it picks up (the client gets a 503 from the router; the prefill
    instance lets go after FDPLUG_KV_PICKUP_TIMEOUT); a transfer that never arrives (from a named
    peer that never answers); a prefill instance killed mid-transfer. Each decode request is a 502
    within FDPLUG_KV_STALL_TIMEOUT (plus the test's slack); every instance left ends with no request
    running and no block held."""
    import zmq

    from tests.conftest import REPO, write_dist
    from tests.serverkit import free_port

    site = write_dist(tmp_path / "site", "fdplug-slowkv", "0.1", {"slowkv": "tests.slow_kv_plugin"})
    env = {"FDPLUG_KV_PICKUP_TIMEOUT": "2", "FDPLUG_KV_STALL_TIMEOUT": "2", "SLOW_KV_LAYER_S": "1",
           "PYTHONPATH": f"{site}:{REPO}"}
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")      # a "prefill instance" that never sends
    kv_port = free_port()
    args = ["--model", pd[0], "--kv-connector", "slow_tcp", *ARGS]
    role_args = {"prefill": ["--kv-port", str(kv_port)],
                 "decode": ["--kv-peers", f"127.0.0.1:{kv_port}", "--kv-peers", f"127.0.0.1:{port}"]}
    servers = {role: Server([*args, "--role", role.rstrip("2"), *role_args[role.rstrip("2")]],
                            tmp_path / f"{role}.log", **env)
               for role in ("prefill", "decode", "decode2")}
    router = start_router(servers["prefill"].url, servers["decode2"].url, tmp_path / "router.log", wait=False)
    try:
        prefill, decode, _ = (servers[role].wait_ready() for role in ("prefill", "decode", "decode2"))
        assert "chosen   slow_tcp" in decode.log()
        router.wait_ready()
        servers["decode2"].proc.kill()                             # decode killed before any pick-up
        servers["decode2"].proc.wait(10)
        began = time.monotonic()
        reply = httpx.post(router.url + "/v1/completions", timeout=60, json={"model": "m", "prompt": PROMPTS[2],
                                                                             "max_tokens": 4})
        assert reply.status_code == 503 and "decode instance" in reply.json()["error"]["message"], reply.text
        assert time.monotonic() - began < 10
        wait_until(lambda: prefill.metrics()["fdplug:kv_cache_usage_perc"] == 0.0, 10, what="the pickup timeout")

        def decode_fails(params: dict, after=None) -> None:
            began = time.monotonic()
            with ThreadPoolExecutor(1) as pool:
                future = pool.submit(httpx.post, decode.url + "/v1/completions", timeout=60, json={
                    "model": "m", "prompt": PROMPTS[2], "max_tokens": 4, "kv_transfer_params": params})
                if after is not None:
                    after()
                reply = future.result()
            assert reply.status_code == 502 and "could not be pulled" in reply.json()["error"]["message"], reply.text
            assert time.monotonic() - began < 10
            wait_until(lambda: decode.metrics()["fdplug:kv_cache_usage_perc"] == 0.0, 10, what="decode's blocks freed")
            assert decode.metrics()["fdplug:num_requests_running"] == 0

        assert f"127.0.0.1:{kv_port}" in prefill.log()              # the endpoint it logs, to name in --kv-peers
        params = prefill_answer(prefill, PROMPTS[2])
        assert params["conn"]["addr"] == f"tcp://127.0.0.1:{kv_port}" and "sig" not in params
        elsewhere = {**params, "conn": {**params["conn"], "addr": f"tcp://127.0.0.1:{free_port()}"}}
        reply = httpx.post(decode.url + "/v1/completions", timeout=30, json={
            "model": "m", "prompt": PROMPTS[2], "max_tokens": 4, "kv_transfer_params": elsewhere})
        assert reply.status_code == 400 and "--kv-peers" in reply.json()["error"]["message"], reply.text
        assert reply.json()["error"]["param"] == "kv_transfer_params"
        decode_fails({**params, "conn": {**params["conn"], "addr": f"tcp://127.0.0.1:{port}"}})
        wait_until(lambda: prefill.metrics()["fdplug:kv_cache_usage_perc"] == 0.0, 10, what="the pickup timeout")
        assert prefill.metrics()["fdplug:num_requests_running"] == 0

        def kill_prefill_mid_transfer() -> None:
            wait_until(lambda: decode.metrics()["fdplug:kv_cache_usage_perc"] > 0, 10, what="the pull under way")
            time.sleep(0.3)                                        # layer 0 landed, layer 1 a second away
            prefill.proc.kill()                                    # its engine process follows it
            prefill.proc.wait(10)

        decode_fails(prefill_answer(prefill, PROMPTS[2]), after=kill_prefill_mid_transfer)
    finally:   # every process ended before anything is asserted (prefill and decode2 were killed)
        silent.close(0)
        router.stop()
        codes = {role: server.stop() for role, server in servers.items()}
    assert codes["decode"] == 0, servers["decode"].log()

