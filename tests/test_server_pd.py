"""`fdplug serve --role prefill` and `--role decode`: a request prefilled by one server, decoded by another.

Driven over HTTP as `fdplug router` will: the prefill instance runs the request with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}`` and answers with where to pull
its KV; the decode instance takes the original request with those params, pulls the KV from the
prefill engine process (ZMQ over TCP) and streams the rest: the same greedy text as one instance,
streamed or not (the second time the decode instance holds the prompts already and tells the
prefill instance to let go of them). Afterwards neither instance runs anything and neither holds KV
blocks. Bad params
are a 400 naming the field, and an instance without ``--role`` refuses them.
"""

from __future__ import annotations

import time

import httpx
import pytest

from fdplug.core.engine.request import SamplingParams
from fdplug.core.frontend.llm import LLM
from tests.conftest import write_test_model
from tests.serverkit import Server, wait_until

PROMPTS = [[5, 9, 2], [11, 3, 8, 21, 34, 55, 89, 14, 23, 37, 60, 97, 57, 54, 11, 65, 76, 41, 17, 58], [7] * 37]
TOKENS = 12
ARGS = ["--max-model-len", "128", "--num-kv-blocks", "64", "--served-model-name", "m"]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    model = str(write_test_model(tmp_path_factory.mktemp("pd") / "m"))
    logs = tmp_path_factory.mktemp("logs")
    prefill = Server(["--model", model, "--role", "prefill", *ARGS], logs / "prefill.log").wait_ready()
    decode = Server(["--model", model, "--role", "decode", *ARGS], logs / "decode.log").wait_ready()
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
    for server in (prefill, decode):          # nothing left running, no block held for a pull
        wait_until(lambda s=server: s.metrics()["fdplug:kv_cache_usage_perc"] == 0.0, 10, what="KV blocks released")
        assert server.metrics()["fdplug:num_requests_running"] == 0


def test_bad_params_are_a_400_naming_the_field(pd, tmp_path):
    _, prefill, decode = pd
    cases = [(prefill, {"do_remote_decode": "yes"}, "must be {\"do_remote_decode\": true}"),
             (decode, {"first_token": 3, "num_prompt_tokens": 3, "block_size": 16,
                       "conn": {"addr": "http://example.com", "transfer_id": "0" * 32, "num_blocks": 1}},
              "not a prefill instance's address"),
             (decode, {"first_token": 10 ** 9, "num_prompt_tokens": 3, "block_size": 16}, "out of range"),
             (decode, {"first_token": 3, "num_prompt_tokens": 4, "block_size": 16}, "do not describe this prompt")]
    for server, params, why in cases:
        reply = httpx.post(server.url + "/v1/completions", timeout=30, json={
            "model": "m", "prompt": [5, 9, 2], "max_tokens": 2, "kv_transfer_params": params})
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
    import subprocess

    from tests.serverkit import FDPLUG, free_port, subprocess_env

    _, prefill, decode = pd
    port = free_port()
    log = open(tmp_path_factory.mktemp("router") / "router.log", "wb")
    proc = subprocess.Popen([FDPLUG, "router", "--prefill", prefill.url, "--decode", decode.url, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=subprocess_env())
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _up(url), 60, 0.1, what="the router answering /health")
    yield url
    proc.terminate()
    assert proc.wait(15) == 0
    log.close()


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


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
    health = httpx.get(router + "/health").json()
    assert health["status"] == "ok" and health["prefill"][0]["alive"] and health["decode"][0]["alive"]


def prefill_answer(prefill: Server, prompt: list[int]) -> dict:
    reply = httpx.post(prefill.url + "/v1/completions", timeout=60, json={
        "model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}})
    assert reply.status_code == 200, reply.text
    return reply.json()["kv_transfer_params"]


def test_faults_end_each_request_within_its_timeout_and_free_every_block(pd, tmp_path):
    """Decode never picks up: the prefill instance lets go after FDPLUG_KV_PICKUP_TIMEOUT. A transfer
    that never arrives, and a prefill instance killed before the pull: the decode request is a 502
    within FDPLUG_KV_STALL_TIMEOUT (plus the test's slack), and the decode instance ends with no
    request and no block held."""
    import zmq

    env = {"FDPLUG_KV_PICKUP_TIMEOUT": "2", "FDPLUG_KV_STALL_TIMEOUT": "1"}
    prefill = Server(["--model", pd[0], "--role", "prefill", *ARGS], tmp_path / "prefill.log", **env).wait_ready()
    decode = Server(["--model", pd[0], "--role", "decode", *ARGS], tmp_path / "decode.log", **env).wait_ready()
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        params = prefill_answer(prefill, PROMPTS[2])
        wait_until(lambda: prefill.metrics()["fdplug:kv_cache_usage_perc"] > 0, 5, what="the blocks held")
        wait_until(lambda: prefill.metrics()["fdplug:kv_cache_usage_perc"] == 0.0, 10, what="the pickup timeout")

        def decode_fails(params: dict) -> None:
            began = time.monotonic()
            reply = httpx.post(decode.url + "/v1/completions", timeout=60, json={
                "model": "m", "prompt": PROMPTS[2], "max_tokens": 4, "kv_transfer_params": params})
            assert reply.status_code == 502 and "could not be pulled" in reply.json()["error"]["message"], reply.text
            assert time.monotonic() - began < 10
            wait_until(lambda: decode.metrics()["fdplug:kv_cache_usage_perc"] == 0.0, 10, what="decode's blocks freed")
            assert decode.metrics()["fdplug:num_requests_running"] == 0

        port = silent.bind_to_random_port("tcp://127.0.0.1")      # a "prefill instance" that never sends
        decode_fails({**params, "conn": {**params["conn"], "addr": f"tcp://127.0.0.1:{port}"}})
        params = prefill_answer(prefill, PROMPTS[2])
        prefill.proc.kill()                                        # its engine process follows it
        prefill.proc.wait(10)
        decode_fails(params)
    finally:
        silent.close(0)
        assert decode.stop() == 0, decode.log()
        prefill.stop()


def test_multimodal_requests_are_refused_by_pd_until_it_serves_them():
    """Decode would compute the prompt's last partial block (image tokens, features and all): refused
    at the HTTP boundary and again when a decode engine admits one."""
    from types import SimpleNamespace

    from fdplug.core.kv_transfer.engine_side import DecodeSide
    from fdplug.errors import InvalidRequestError
    from fdplug.server.pd_params import check_kv_transfer_params

    with pytest.raises(InvalidRequestError, match="multimodal items"):
        check_kv_transfer_params({"do_remote_decode": True}, "prefill", 1, 256, multimodal=True)
    side = DecodeSide.__new__(DecodeSide)
    request = SimpleNamespace(kv_transfer_params={"first_token": 3}, mm_inputs=[object()])
    with pytest.raises(InvalidRequestError, match="multimodal items"):
        side.admit(request)
