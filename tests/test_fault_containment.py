"""The nine hostile inputs of the fault-containment issue, against a live ``fdplug serve``.

Each test sends the hostile request while bystander streams are mid-generation, and checks both
sides: the hostile request gets a 400 naming what was wrong (never a 500), and every bystander
finishes with exactly the greedy tokens it gets alone. One server (the sharp multimodal test model)
for the module; every test leaves it serving.
"""

from __future__ import annotations

import asyncio
import io
import json
import time

import httpx
import numpy as np
import pytest

from tests.serverkit import Server

HIDDEN = 64           # the sharp test model's hidden size (feature rows must have it)
MAX_MODEL_LEN = 1024
BYSTANDER_TOKENS = 1000   # still decoding when the hostile requests are answered, on a fast CPU too


@pytest.fixture(scope="module")
def server(test_model_dir, tmp_path_factory):
    features = tmp_path_factory.mktemp("features")
    rows = np.random.default_rng(0).standard_normal((16, HIDDEN)).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, rows)
    (features / "sixteen.npy").write_bytes(buf.getvalue())
    srv = Server(["--model", str(test_model_dir), "--served-model-name", "m", "--max-model-len", str(MAX_MODEL_LEN),
                  "--num-kv-blocks", "400", "--max-waiting-requests", "64", "--allowed-feature-path", str(features)],
                 tmp_path_factory.mktemp("serve") / "containment.log").wait_ready()
    srv.features = features
    yield srv
    assert srv.stop() == 0, srv.log()


def post(server, path: str, body, timeout: float = 30.0) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=timeout,
                      headers={"Content-Type": "application/json"})


def assert_400(response: httpx.Response, *, param: str | None = None, says: tuple[str, ...] = ()) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    for text in says:
        assert text in error["message"], error["message"]
    return error


# -- bystanders -------------------------------------------------------------------------------------

BYSTANDER_PROMPTS = [[5 + i, 40 + 3 * i, 7, 99 - i, 13 * (i + 1)] for i in range(4)]


async def _bystander(server, prompt: list[int], salt: str, started: asyncio.Event | None = None) -> str:
    """A streamed greedy completion of ``BYSTANDER_TOKENS`` tokens; returns its text."""
    client = server.async_openai()
    stream = await client.completions.create(model="m", prompt=prompt, max_tokens=BYSTANDER_TOKENS, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True, "cache_salt": salt})
    text, finish = [], None
    async for chunk in stream:
        choice = chunk.choices[0]
        text.append(choice.text)
        finish = choice.finish_reason or finish
        if started is not None:
            started.set()
    assert finish == "length", finish
    return "".join(text)


def _alone(server) -> list[str]:
    """Each bystander's text when it runs with nobody else (its own cache salt: no prefix hits)."""
    async def run():
        salt = f"alone-{time.monotonic_ns()}"
        return [await _bystander(server, p, f"{salt}-{i}") for i, p in enumerate(BYSTANDER_PROMPTS)]
    return asyncio.run(run())


@pytest.fixture(scope="module")
def reference(server) -> list[str]:
    return _alone(server)


def with_bystanders(server, reference: list[str], hostile) -> list:
    """Start the bystander streams, wait until each has its first tokens, then send ``hostile()`` (in
    a thread): the hostile requests reach the server while the bystanders decode. The bystanders
    must finish exactly as they did alone, and still be running when the hostile requests are done."""
    async def run():
        salt = f"by-{time.monotonic_ns()}"
        started = [asyncio.Event() for _ in BYSTANDER_PROMPTS]
        tasks = [asyncio.create_task(_bystander(server, p, f"{salt}-{i}", started[i]))
                 for i, p in enumerate(BYSTANDER_PROMPTS)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30.0)
        results = await asyncio.to_thread(hostile)
        overlapped = sum(not t.done() for t in tasks)
        texts = await asyncio.wait_for(asyncio.gather(*tasks), 60.0)
        return results, texts, overlapped
    results, texts, overlapped = asyncio.run(run())
    assert texts == reference
    assert overlapped > 0, "the bystanders finished before the hostile requests: make them longer"
    return results


# -- the nine cases ---------------------------------------------------------------------------------


def test_1_huge_top_k_is_a_400_and_bystanders_finish(server, reference):
    results = with_bystanders(server, reference, lambda: [
        post(server, "/v1/completions", {"prompt": "x", "top_k": 9223372036854775808}),
        post(server, "/v1/completions", {"prompt": "x", "top_k": 2**31}),
        post(server, "/v1/completions", {"prompt": "x", "top_k": -2})])
    for r in results:
        assert_400(r, param="top_k", says=("top_k",))
    assert "vocabulary" in results[0].json()["error"]["message"]
    # the bound is the vocabulary: its size is fine (the same as off), one more is not
    vocab_size = _vocab_size(server)
    assert post(server, "/v1/completions", {"prompt": "x", "top_k": vocab_size, "max_tokens": 2}).status_code == 200
    assert_400(post(server, "/v1/completions", {"prompt": "x", "top_k": vocab_size + 1}), param="top_k",
               says=(str(vocab_size),))


def _vocab_size(server) -> int:
    config = json.loads((server_model_dir(server) / "config.json").read_text())
    return config["vocab_size"]


def server_model_dir(server):
    from pathlib import Path

    return Path(json.loads(httpx.get(server.url + "/v1/models").text)["data"][0]["root"])


def test_2_seed_past_int64_is_a_400_and_bystanders_finish(server, reference):
    results = with_bystanders(server, reference, lambda: [
        post(server, "/v1/completions", {"prompt": "x", "seed": 2**63}),
        post(server, "/v1/completions", {"prompt": "x", "seed": 2**64 - 1}),
        post(server, "/v1/completions", {"prompt": "x", "seed": -(2**63) - 1})])
    for r in results:
        assert_400(r, param="seed", says=("seed", "9223372036854775807"))
    # the edges of the range are served, and n > 1 children of the largest seed do not overflow
    for seed in (2**63 - 1, -(2**63)):
        r = post(server, "/v1/completions", {"prompt": "x", "seed": seed, "n": 3, "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 3


def test_3_seed_past_uint64_is_a_400(server, reference):
    results = with_bystanders(server, reference, lambda: [
        post(server, "/v1/completions", {"prompt": "x", "seed": 2**64}),
        post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": 10**30})])
    for r in results:
        assert_400(r, param="seed")


def test_4_n_over_the_cap_is_a_400_not_a_503(server):
    for n in (129, 10_000, 100_000):
        assert_400(post(server, "/v1/completions", {"prompt": "x", "n": n}), param="n", says=("128",))
    # a batch of prompts whose sequences can never all be queued: 400 naming both numbers
    r = post(server, "/v1/completions", {"prompt": ["a"] * 40, "n": 2})
    assert_400(r, param="n", says=("80", "64"))
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_5_chat_template_kwargs_colliding_with_fields_are_400s(server):
    base = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for key, value in (("add_generation_prompt", False), ("messages", []), ("tools", []), ("documents", []),
                       ("content_part_handler", 1), ("__fdplug_iter", 1), ("_x", 1)):
        r = post(server, "/v1/chat/completions", {**base, "chat_template_kwargs": {key: value}})
        assert_400(r, param=f"chat_template_kwargs.{key}")
    for kwargs in ({"enable_thinking": False}, {"self": 1, "variables": 2, "kwargs": 3, "chat_template_x": 4}):
        ok = post(server, "/v1/chat/completions", {**base, "chat_template_kwargs": kwargs})
        assert ok.status_code == 200, ok.text   # names of Python parameters are just template variables


def test_6_request_chat_templates_are_refused_without_the_flag(server):
    bomb = "{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}x"
    base = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    t0 = time.monotonic()
    assert_400(post(server, "/v1/chat/completions", {**base, "chat_template_kwargs": {"chat_template": bomb}}),
               param="chat_template_kwargs.chat_template", says=("--trust-request-chat-template",))
    assert_400(post(server, "/v1/chat/completions", {**base, "chat_template": bomb}), param="chat_template",
               says=("--trust-request-chat-template",))
    assert time.monotonic() - t0 < 0.5 * 10   # refused before rendering anything (generous: CI runners stall)
    # naming one of the model's own templates is not a request-supplied template
    r = post(server, "/v1/chat/completions", {**base, "chat_template": "no-such-template"})
    assert_400(r, param="chat_template")


def test_7_malformed_tool_calls_are_400s(server):
    for calls, param in ((5, "messages.0.tool_calls"), ("x", "messages.0.tool_calls"),
                         ([5], "messages.0.tool_calls.0"), ([{"function": 3}], "messages.0.tool_calls.0.function"),
                         ([{"function": {"name": 1}}], "messages.0.tool_calls.0.function.name"),
                         ([{"function": {"name": "f", "arguments": 7}}], "messages.0.tool_calls.0.function.arguments"),
                         ([{"function": {"name": "f", "arguments": "{not json"}}],
                          "messages.0.tool_calls.0.function.arguments")):
        body = {"messages": [{"role": "assistant", "content": None, "tool_calls": calls},
                             {"role": "user", "content": "x"}], "max_tokens": 2}
        assert_400(post(server, "/v1/chat/completions", body), param=param)
    good = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]
    body = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": good},
                         {"role": "tool", "tool_call_id": "c1", "content": "2"}], "max_tokens": 2}
    assert post(server, "/v1/chat/completions", body).status_code == 200


def image(url: str, grid, **extra) -> dict:
    return {"type": "image_feature", "image_feature": {"url": url, "grid_thw": list(grid), **extra}}


def chat_with(parts: list[dict], **extra) -> dict:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "what?"}]}],
            "max_tokens": 4, "temperature": 0, **extra}


def _rss_kb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_8_a_huge_grid_is_sized_before_anything_is_allocated(server):
    url = (server.features / "sixteen.npy").as_uri()
    before = _rss_kb(server.proc.pid)
    for grid in ([1, 4294967296, 4294967296], [1, 2**40, 2], [1, 4096, 4096], [1, 2**70, 2**70]):
        r = post(server, "/v1/chat/completions", chat_with([image(url, grid)]))
        error = assert_400(r, says=(str(MAX_MODEL_LEN),))
        assert "max_model_len" in error["message"]
    # the placeholder count is named as a number; nothing near it was allocated
    assert _rss_kb(server.proc.pid) - before < 50_000


def test_9_a_cached_uuid_with_another_grid_is_a_400_and_bystanders_finish(server, reference):
    url = (server.features / "sixteen.npy").as_uri()
    first = post(server, "/v1/chat/completions", chat_with([image(url, (1, 8, 8), uuid="sixteen")]))
    assert first.status_code == 200, first.text      # 16 rows, 16 tokens: cached under the uuid

    results = with_bystanders(server, reference, lambda: [
        post(server, "/v1/chat/completions", chat_with([image(url, (1, 8, 16), uuid="sixteen")])),
        post(server, "/v1/chat/completions", chat_with([image(url, (1, 4, 4), uuid="sixteen")]))])
    assert_400(results[0], says=("16", "32"))
    assert_400(results[1], says=("16", "4"))
    again = post(server, "/v1/chat/completions", chat_with([image(url, (1, 8, 8), uuid="sixteen")]))
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == \
        first.json()["choices"][0]["message"]["content"]


def test_a_client_gone_before_its_stream_starts_is_not_served(server):
    """Streams whose client hangs up at once (before the first event can be sent) are aborted,
    not generated to their max_tokens for nobody."""
    import socket

    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 200, "stream": True, "ignore_eos": True})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
    aborted, finished = server.finished("abort"), server.finished("length")
    for _ in range(8):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(request)
    deadline = time.monotonic() + 30
    while server.finished("abort") - aborted < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.finished("abort") - aborted == 8
    assert server.finished("length") == finished


# -- no leak on any failure path --------------------------------------------------------------------


def test_failing_requests_leave_no_trace_in_the_api_process(server):
    """Thousands of requests that fail at every stage: parsing, validation, and in the engine after
    the API process registered them (a cached uuid with the wrong grid). The API's memory stays flat."""
    url = (server.features / "sixteen.npy").as_uri()
    assert post(server, "/v1/chat/completions", chat_with([image(url, (1, 8, 8), uuid="sixteen")])).status_code == 200
    bodies = [
        json.dumps({"prompt": "x", "seed": 2**64}),                                  # too big for msgpack
        json.dumps({"prompt": "x", "top_k": 2**63}),
        json.dumps({"prompt": [1, 2, 10**9]}),
        json.dumps(chat_with([image(url, (1, 8, 16), uuid="sixteen")])),           # refused by the engine
        '{"prompt": "x", "n": 100000}',
        '{"prompt": ',
    ]
    pid = server.proc.pid

    def soak(rounds: int) -> None:
        with httpx.Client(base_url=server.url, timeout=30.0, headers={"Content-Type": "application/json"}) as c:
            for i in range(rounds):
                r = c.post("/v1/completions" if "prompt" in bodies[i % len(bodies)] else "/v1/chat/completions",
                           content=bodies[i % len(bodies)])
                assert 400 <= r.status_code < 500, r.text

    soak(600)    # warm up: caches, arenas, lazily built things
    before = _rss_kb(pid)
    soak(3000)
    after = _rss_kb(pid)
    print(f"API RSS before {before} kB, after 3000 failing requests {after} kB")
    assert after - before < 3_000, (before, after)   # the leak was ~4 kB per request: 12 MB here
    assert httpx.get(server.url + "/health").status_code == 200
