"""Hypothesis against a live ``fdplug serve``: hostile bodies for both endpoints, never a 5xx or a hang.

Each example is a batch of one to four request bodies sent at once: every field of both endpoints
(OpenAI's, vLLM's extras, unknown ones), with plausible values mixed with hostile ones (huge and
negative numbers, NaN and infinity, wrong types, deep nesting, feature parts with absurd grids, a
reused uuid with another grid, colliding template kwargs, chat templates that loop), raw bytes, and
clients that hang up mid-answer. Properties: no response is a 5xx (a streamed one carries no server error either), every
response
arrives within its timeout, and after each batch a plain greedy request gets exactly the tokens it
got at the start.

CI runs ``FDPLUG_FUZZ_EXAMPLES`` (default 100) examples from a fixed seed, so a red run is
reproducible; set ``FDPLUG_FUZZ_SEED`` to explore other cases.
"""

from __future__ import annotations

import asyncio
import io
import json
import os

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.serverkit import Server

HIDDEN = 64
EXAMPLES = int(os.environ.get("FDPLUG_FUZZ_EXAMPLES", "100"))
SEED = int(os.environ.get("FDPLUG_FUZZ_SEED", "20261123"))
TIMEOUT = 60.0
CANARY = {"prompt": [11, 22, 33, 44, 55], "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(test_model_dir, tmp_path_factory):
    features = tmp_path_factory.mktemp("features")
    for rows in (4, 16):
        buf = io.BytesIO()
        np.save(buf, np.random.default_rng(rows).standard_normal((rows, HIDDEN)).astype(np.float32))
        (features / f"rows{rows}.npy").write_bytes(buf.getvalue())
    srv = Server(["--model", str(test_model_dir), "--served-model-name", "m", "--max-model-len", "128",
                  "--num-kv-blocks", "300", "--max-num-seqs", "16", "--max-waiting-requests", "64",
                  "--allowed-feature-path", str(features), "--trust-request-chat-template"],
                 tmp_path_factory.mktemp("serve") / "fuzz.log", FDPLUG_FETCH_TIMEOUT="5").wait_ready()
    srv.features = features
    srv.canary = canary(srv)
    yield srv
    assert srv.stop() == 0, srv.log()


def canary(server) -> str:
    r = httpx.post(server.url + "/v1/completions", json=CANARY, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# -- values ---------------------------------------------------------------------------------------

EDGE_INTS = [0, 1, -1, 2, 20, 21, 127, 128, 129, 255, 256, 511, 512, 2**31 - 1, 2**31, 2**32, 2**53 + 1,
             2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 10**30, -(10**30), 10**400]
EDGE_FLOATS = [0.0, -0.0, 1e-45, 1e-6, 0.5, 1.0, 1.0000001, 2.0, 100.0, 1e38, 3.5e38, 1e308, -1.0, -1e308,
               float("nan"), float("inf"), float("-inf")]

ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-1000, 1000), st.integers())
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=True, allow_infinity=True))
texts = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "\x00", "<|im_start|>", "<|image_pad|>",
                                                         "\ud800".encode("utf-8", "surrogatepass").decode("latin-1"),
                                                         "x" * 5000]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(texts, inner, max_size=4)), max_leaves=8)


def field(valid, edge=None) -> tuple:
    """A field's valid values, and the edge values ``hostile`` may swap in (else anything at all)."""
    return valid, edge if edge is not None else junk


@st.composite
def hostile(draw, body: dict, fields: dict) -> dict:
    """Half the bodies as drawn; the others with one field replaced by an edge value or junk."""
    if draw(st.booleans()):
        return body
    key = draw(st.sampled_from(sorted(fields) + ["unknown", "echo", "suffix", "best_of", "logit_bias", "tools",
                                                  "stream_options"]))
    edge = fields[key][1] if key in fields else junk
    return {**body, key: draw(st.one_of(edge, junk))}


def draw_body(draw, fields: dict, required: tuple = ()) -> dict:
    body = {}
    for name, (valid, _) in fields.items():
        if name in required or draw(st.integers(0, 2)) == 0:
            body[name] = draw(valid)
    return body


token_ids = st.lists(st.integers(0, 511), max_size=20)
bad_token_ids = st.lists(st.one_of(st.integers(0, 600), st.sampled_from([-1, 2**63, 10**9])), min_size=1, max_size=20)
SAMPLING = {
    "model": field(st.just("m"), st.sampled_from(["other", ""])),
    "n": field(st.integers(1, 3), ints),
    "stream": field(st.booleans()),
    "max_tokens": field(st.integers(1, 12), ints),
    "temperature": field(st.sampled_from([0, 0.7, 1.5, 100]), floats),
    "top_p": field(st.sampled_from([0.9, 1, 1e-9]), floats),
    "top_k": field(st.sampled_from([-1, 0, 1, 5, 512]), ints),
    "min_p": field(st.sampled_from([0, 0.1, 1]), floats),
    "stop": field(st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=3)),
                  st.lists(texts, max_size=70)),
    "presence_penalty": field(st.floats(-2, 2), floats),
    "frequency_penalty": field(st.floats(-2, 2), floats),
    "repetition_penalty": field(st.sampled_from([1.1, 0.9, 0.01, 100]), floats),
    "seed": field(st.integers(-(2**63), 2**63 - 1), ints),
    "user": field(st.text(max_size=5)),
    "min_tokens": field(st.integers(0, 1), ints),
    "ignore_eos": field(st.booleans()),
    "stop_token_ids": field(token_ids, bad_token_ids),
    "skip_special_tokens": field(st.booleans()),
    "cache_salt": field(st.text(max_size=8), texts),
}
COMPLETION = {
    **SAMPLING,
    "prompt": field(st.one_of(st.text(min_size=1, max_size=40), token_ids, st.lists(st.text(max_size=20), max_size=3),
                              st.lists(token_ids, max_size=3)), st.one_of(bad_token_ids, texts)),
    "logprobs": field(st.integers(0, 20), ints),
}


def feature_part(urls) -> st.SearchStrategy:
    """An image/video feature part: mostly the grids of the two feature files (4 and 16 rows), reused
    uuids (so a cached uuid meets another grid), absurd grids, wrong URLs, junk."""
    grid = st.one_of(st.sampled_from([[1, 4, 4], [1, 8, 8], [1, 4, 4], [1, 8, 8], [1, 8, 16], [2, 4, 4],
                                      [1, 4294967296, 4294967296], [1, 2**70, 2], [0, 4, 4], [1, 3, 4]]),
                     st.lists(ints, max_size=4))
    body = st.fixed_dictionaries({"url": urls, "grid_thw": grid},
                                 optional={"uuid": st.sampled_from(["u1", "u2", ""]), "urls": st.lists(urls)})
    kind = st.sampled_from(["image_feature", "image_feature", "video_feature"])
    return st.builds(lambda k, b: {"type": k, k: b}, kind, st.one_of(body, body, body, junk))


TEMPLATES = ["{% for m in messages %}{{ m.content }}{% endfor %}",
             "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
             "{{ 'x' * 10**10 }}", "{{ 2 ** 2 ** 40 }}", "{{ 'a'.ljust(10**9) }}", "{{ ''.__class__ }}",
             "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
             "{{ raise_exception('no') }}", "{% for x in", "{{ '%0999999999d' % 1 }}", "tool_use", "default"]


TOOL_CALLS = st.lists(st.fixed_dictionaries({"id": st.text(max_size=4), "type": st.just("function"), "function":
                                             st.fixed_dictionaries({"name": st.text(max_size=4),
                                                                    "arguments": st.sampled_from(["{}", '{"a": 1}'])})
                                             }), max_size=2)


@st.composite
def chat_body(draw, urls):
    def part():
        if draw(st.integers(0, 2)) == 0:
            return draw(feature_part(urls))
        return {"type": "text", "text": draw(st.text(max_size=30))}

    def message():
        role = draw(st.sampled_from(["system", "user", "assistant"]))
        msg = {"role": role, "content": draw(st.one_of(st.text(max_size=30), st.lists(st.builds(part), max_size=3)))}
        if role == "assistant" and draw(st.booleans()):
            msg["tool_calls"] = draw(st.one_of(TOOL_CALLS, junk, st.lists(junk, max_size=2)))
        return msg

    fields = {
        **SAMPLING, "max_completion_tokens": field(st.integers(1, 12), ints),
        "logprobs": field(st.booleans()), "top_logprobs": field(st.integers(0, 20), ints),
        "response_format": field(st.just({"type": "text"}), st.just({"type": "json_object"})),
        "add_generation_prompt": field(st.booleans()),
        "chat_template": field(st.sampled_from(["default", TEMPLATES[0]]), st.sampled_from(TEMPLATES)),
        "chat_template_kwargs": field(st.dictionaries(st.just("enable_thinking"), st.booleans()), st.dictionaries(
            st.sampled_from(["enable_thinking", "add_generation_prompt", "messages", "tools", "chat_template",
                             "documents", "bos_token", "x", "self", "kwargs", "__fdplug_iter", "content_part_handler"]),
            st.one_of(junk, st.sampled_from(TEMPLATES)), max_size=3)),
        "messages": field(st.lists(st.builds(message), min_size=1, max_size=3)),
    }
    body = draw_body(draw, fields, ("messages",))
    if body.get("top_logprobs") is not None:
        body["logprobs"] = True
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = draw(st.integers(1, 12))   # keep the valid ones short: the suite has a time budget
    return draw(hostile(body, fields))


@st.composite
def completion_body(draw):
    return draw(hostile(draw_body(draw, COMPLETION, ("prompt",)), COMPLETION))


RAW = st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"{", b"[]", b"null", b"1e999999", b'{"prompt": "x"',
                                                         b"[" * 100000, b'{"prompt": ' + b"[" * 3000,
                                                         b'{"prompt": "x", "n": 1e400}']))


def request_strategy(urls):
    paths = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
    hang_up = st.one_of(st.none(), st.none(), st.none(), st.integers(0, 2000))
    return st.one_of(*[st.tuples(st.just("/v1/completions"), completion_body(), hang_up),
                       st.tuples(st.just("/v1/chat/completions"), chat_body(urls), hang_up)] * 4,
                     st.tuples(paths, RAW, st.none()))


async def send(client: httpx.AsyncClient, path: str, body, hang_up_after: int | None) -> tuple[int, str]:
    """POST ``body``; with ``hang_up_after``, close the connection after that many bytes of the answer
    (a client that leaves mid-stream: its sequences must be aborted, nobody else disturbed)."""
    content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True)
    async with client.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as r:
        if hang_up_after is None or r.status_code != 200:
            return r.status_code, (await r.aread()).decode("utf-8", "replace")
        received = b""
        async for chunk in r.aiter_raw():
            received += chunk
            if len(received) > hang_up_after:
                break
    return r.status_code, received.decode("utf-8", "replace").rpartition("\n\n")[0]


def check(status: int, text: str, path: str, body) -> None:
    where = f"{path} {str(body)[:600]!r}"
    assert status < 500, f"{status} for {where}: {text[:400]}"
    if status == 200 and text.startswith("data:"):
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                error = json.loads(line[6:])["error"]
                assert not (isinstance(error.get("code"), int) and error["code"] >= 500), f"{error} for {where}"


def test_hostile_bodies_never_get_a_5xx_nor_hang_nor_disturb_others(server):
    good = [(server.features / "rows4.npy").as_uri(), (server.features / "rows16.npy").as_uri()]
    urls = st.sampled_from([*good, *good, *good, (server.features / "missing.npy").as_uri(), "file:///etc/passwd", "http://example.com/x",
                            "bos://bucket/x.npy", "ftp://x", "", "file://" + "a" * 300])
    statuses: dict[int, int] = {}
    reasons: dict[str, int] = {}

    @seed(SEED)
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                                     HealthCheck.filter_too_much])
    @given(st.lists(request_strategy(urls), min_size=1, max_size=4))
    def batch(requests):
        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
                return await asyncio.gather(*(send(client, *request) for request in requests))
        for (status, text), (path, body, _) in zip(asyncio.run(run()), requests):
            check(status, text, path, body)
            statuses[status] = statuses.get(status, 0) + 1
            if os.environ.get("FDPLUG_FUZZ_VERBOSE") and status >= 400:
                reasons[text[30:90]] = reasons.get(text[30:90], 0) + 1
        assert canary(server) == server.canary, "a normal request after the batch got other tokens"

    batch()
    print(f"fuzz: {EXAMPLES} batches, {sum(statuses.values())} requests, by status {dict(sorted(statuses.items()))}")
    assert httpx.get(server.url + "/health").status_code == 200
    for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1])[:25]:
        print(f"{count:5d} {reason}")
    log = server.log()
    assert "bug while serving" not in log, log[-3000:]                           # no 500 from the API process
    assert "finding the requests that caused it" not in log, log[-3000:]       # nothing got past admission


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(server):
    """OpenAI's ``reasoning_effort`` becomes the template variable of that name (gpt-oss templates
    read it); ``chat_template_kwargs`` naming it wins."""
    def prompt_tokens(**extra):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                "chat_template": "{{ messages[0]['content'] }} effort={{ reasoning_effort | default('unset') }}"}
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, **extra}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    def count(text):
        r = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=TIMEOUT)
        return r.json()["count"]

    assert prompt_tokens() == count("hi effort=unset")
    assert prompt_tokens(reasoning_effort="medium") == count("hi effort=medium")
    assert prompt_tokens(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}) == \
        count("hi effort=high")
