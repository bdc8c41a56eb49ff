"""`fdplug serve` on the demo model, driven over HTTP: shapes, auth, errors, metrics, disconnects.

One server for the module (with an API key and a small body limit); every test leaves it serving.
"""

from __future__ import annotations

import json
import re
import socket

import httpx
import openai
import pytest

from tests.serverkit import SMALL, Server, wait_until

KEY = "sk-test-0123456789"
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server([*SMALL, "--max-body-bytes", str(MAX_BODY)], tmp_path_factory.mktemp("serve") / "demo.log",
                 api_key=KEY).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()
    assert KEY not in srv.log()


def post(server, path, body, headers=None, timeout=30.0):
    content = json.dumps(body) if isinstance(body, (dict, list)) else body
    return httpx.post(server.url + path, content=content, timeout=timeout,
                      headers={"Content-Type": "application/json", **server.headers, **(headers or {})})


def assert_error(response, status, *, param=None, contains=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    for part in (contains,) if isinstance(contains, str) else contains or ():
        assert part in error["message"], error["message"]
    return error


# -- happy paths ------------------------------------------------------------------------------------


def test_models_version_health(server):
    models = server.openai().models.list()
    assert [m.id for m in models.data] == ["demo"]
    assert httpx.get(server.url + "/version").json()["version"]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and [e["rank"] for e in health["engines"]] == [0] and health["engines"][0]["alive"]


def test_chat_completion_shape(server):
    r = server.openai().chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=5, temperature=0, user="u1")
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "demo"
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens <= 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_the_demo_answers_hello_in_words_and_each_prompt_differently(server):
    """`fdplug serve` with no model: the trained demo answers over HTTP, and what is sent reaches it."""
    client = server.openai()
    hello = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=24, temperature=0).choices[0].message.content
    assert "\ufffd" not in hello and len(re.findall(r"[A-Za-z]{2,}", hello)) >= 5, hello
    texts = {client.completions.create(model="demo", prompt=p, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
             for p in ('The "if" statement', "A class definition", "import")}
    assert len(texts) == 3, texts


def test_completion_shapes_and_prompt_forms(server):
    client = server.openai()
    text = client.completions.create(model="demo", prompt="Hello", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert text.id.startswith("cmpl-") and text.object == "text_completion"
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 4
    ids = client.completions.create(model="demo", prompt=[72, 101, 108], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3
    batch = client.completions.create(model="demo", prompt=["a", "b", "a"], max_tokens=2, temperature=0, n=2,
                                      extra_body={"ignore_eos": True})
    assert sorted(c.index for c in batch.choices) == list(range(6))
    assert batch.usage.completion_tokens == 12
    by_index = {c.index: c.text for c in batch.choices}
    assert by_index[0] == by_index[1] == by_index[4] == by_index[5]   # greedy: n copies and equal prompts agree
    id_batch = client.completions.create(model="demo", prompt=[[72, 101], [108]], max_tokens=1, temperature=0)
    assert id_batch.usage.prompt_tokens == 3 and len(id_batch.choices) == 2


def test_stream_matches_non_stream(server):
    client = server.openai()
    messages = [{"role": "user", "content": "Tell me a story"}]
    full = client.chat.completions.create(model="demo", messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_raw_sse_ends_with_done(server):
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers, timeout=30,
                      json={"prompt": "x", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


# -- auth -------------------------------------------------------------------------------------------


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert_error(r, 401)
        assert KEY not in r.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200      # probes and scrapers stay open
    assert httpx.get(server.url + "/metrics").status_code == 200


# -- bad input --------------------------------------------------------------------------------------

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path, body, status, param, contains", [
    ("/v1/chat/completions", {**CHAT, "max_token": 5}, 400, "max_token", "unrecognized"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, 400, None, "temperature"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "5"}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "n": 0}, 400, None, "n must be"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, None, "top_p"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, None, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, None, "role"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 1}}, 400, "logit_bias", None),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/v1/chat/completions", {"messages": CHAT["messages"], "model": "gpt-4"}, 404, "model", "gpt-4"),
    ("/v1/chat/completions", "{not json", 400, None, "JSON"),
    ("/v1/completions", {"model": "demo"}, 400, "prompt", "required"),
    ("/v1/completions", {"model": "demo", "prompt": []}, 400, None, "empty"),
    ("/v1/completions", {"model": "demo", "prompt": [1, 99999]}, 400, None, "vocabulary"),
    ("/v1/completions", {"model": "demo", "prompt": "a " * 600}, 400, None, "max_model_len"),
    ("/v1/completions", {"model": "demo", "prompt": "hello", "max_tokens": 600}, 400, "max_tokens",
     ("maximum context length is 512 tokens", "600 for the completion")),
    ("/v1/completions", {"model": "demo", "prompt": "hello", "logprobs": 50}, 400, None, "logprobs"),
    ("/v1/completions", {"model": "demo", "prompt": "hello", "echo": True}, 400, "echo", None),
    ("/v1/completions", {"model": "demo", "prompt": ["a", [1]]}, 400, "prompt", "accepted types"),
])
def test_bad_requests(server, path, body, status, param, contains):
    assert_error(post(server, path, body), status, param=param, contains=contains)


def test_body_limit(server):
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BODY}]})
    assert_error(post(server, "/v1/chat/completions", big), 413)

    def chunked():  # no Content-Length: the limit holds while reading
        for _ in range(MAX_BODY // 1024 + 2):
            yield b" " * 1024

    assert_error(post(server, "/v1/chat/completions", chunked()), 413)


def test_unknown_route_and_method(server):
    assert_error(httpx.get(server.url + "/v1/nothing", headers=server.headers), 404)
    assert_error(httpx.get(server.url + "/v1/completions", headers=server.headers), 405)


def test_still_serves_after_errors(server):
    for _ in range(3):
        assert_error(post(server, "/v1/chat/completions", {**CHAT, "n": -1}), 400, param="n", contains="n must be")
    r = server.openai().chat.completions.create(**CHAT, max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")


# -- disconnects and metrics ------------------------------------------------------------------------


def test_client_disconnect_frees_blocks(server):
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers, timeout=30,
                      json={"prompt": "Hello " * 25, "max_tokens": 400, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        wait_until(lambda: server.metrics()["fdplug:num_requests_running"] == 1, 10, what="request running")
        assert server.metrics()["fdplug:kv_cache_usage_perc"] > 0
    # closed mid-stream: the engine aborts the request and frees its blocks
    wait_until(lambda: (m := server.metrics())["fdplug:num_requests_running"] == 0
               and m["fdplug:kv_cache_usage_perc"] == 0, 10, what="blocks freed")


def test_non_streaming_disconnect_aborts(server):
    """Closed while the engine runs it (seen in the metrics, not guessed from a timeout), the request is
    aborted, not finished. A fast machine generates these 500 tokens in a third of a second, and on a
    busy one the engine may finish them before the API process gets the core back to see the close
    (the CI saw it once, AMD EPYC, avx512): such a try counts as finished, and another is made."""
    body = json.dumps({"prompt": "Hi", "max_tokens": 500, "ignore_eos": True}).encode()
    outcomes = []
    while len(outcomes) < 3 and "abort" not in outcomes:
        before = {reason: server.finished(reason) for reason in ("abort", "length")}
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n" % (KEY.encode(), len(body)) + body)
            wait_until(lambda: server.metrics()["fdplug:num_requests_running"] == 1, 10, 0.005, what="request running")
        outcomes += wait_until(lambda b=before: [r for r in b if server.finished(r) == b[r] + 1], 10,
                               what="the request ended")
        wait_until(lambda: (m := server.metrics())["fdplug:num_requests_running"] == 0
                   and m["fdplug:kv_cache_usage_perc"] == 0, 10, what="blocks freed")
    assert "abort" in outcomes, outcomes


def test_metrics(server):
    server.openai().completions.create(model="demo", prompt="metrics", max_tokens=3, temperature=0)
    m = server.metrics()
    for name in ("fdplug:num_requests_running", "fdplug:num_requests_waiting", "fdplug:kv_cache_usage_perc",
                 "fdplug:prefix_cache_hit_rate", "fdplug:engine_alive"):
        assert name in m, name
    assert m["fdplug:time_to_first_token_seconds_count"] >= 1
    assert m["fdplug:inter_token_latency_seconds_count"] >= 1
    assert m["fdplug:prompt_tokens_total"] >= 1 and m["fdplug:generation_tokens_total"] >= 3
    assert m["fdplug:engine_alive"] == 1


def test_the_data_parallel_rank_header_names_the_one_engine_or_is_a_400(server):
    body = {"model": "demo", "prompt": [5, 6], "max_tokens": 1}
    ok = httpx.post(server.url + "/v1/completions", json=body, headers={**server.headers, "X-Data-Parallel-Rank": "0"})
    assert ok.status_code == 200, ok.text
    reply = httpx.post(server.url + "/v1/completions", json=body,
                       headers={**server.headers, "X-Data-Parallel-Rank": "1"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "X-Data-Parallel-Rank", reply.text
    assert "(0..0)" in reply.json()["error"]["message"]


# -- OpenAI's nullable fields, vLLM's extras ----------------------------------------------------------


def test_null_is_a_field_left_out(server):
    """OpenAI types its optional fields "or null"; clients send unset ones so (the openai client's
    ``max_tokens=None``): each takes its default, and completions' max_tokens stays OpenAI's 16."""
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": None,
                                                 "n": None, "logprobs": None, "max_tokens": 3, "stream_options": None})
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 1, chat.text
    assert chat.json()["choices"][0]["logprobs"] is None
    done = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": None, "echo": None, "ignore_eos": True,
                                            "min_tokens": None, "temperature": None})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 16, done.text


def test_stop_reason_names_the_stop_string_or_token(server):
    body = {"prompt": "A class definition", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    stop = text[3:6]
    assert len(stop) == 3 and text.index(stop) == 3
    choice = post(server, "/v1/completions", {**body, "stop": [stop, "@@@"]}).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (text[:3], "stop", stop)
    kept = post(server, "/v1/completions", {**body, "stop": stop, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == text[:6]
    first = post(server, "/tokenize", {"prompt": "Hello", "add_special_tokens": False}).json()["tokens"][0]
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                                                 "guided_choice": ["Hello"], "stop_token_ids": [first]}).json()
    assert (chat["choices"][0]["finish_reason"], chat["choices"][0]["stop_reason"]) == ("stop", first)
    assert post(server, "/v1/completions", {**body, "max_tokens": 2}).json()["choices"][0]["stop_reason"] is None
    assert post(server, "/v1/completions", {**body, "stop": ""}).json()["choices"][0]["text"] == text   # (as null)
    assert_error(post(server, "/v1/completions", {**body, "stop": [""]}), 400, param="stop")
    assert_error(post(server, "/v1/completions", {**body, "max_token": None}), 400, param="max_token")


def test_logprob_bytes_rebuild_a_character_its_tokens_split(server):
    """Each byte-level token of a CJK character decodes alone to U+FFFD; its ``bytes`` are its own, so
    joined they are the text (OpenAI's reason for the field), and ``text_offset`` counts characters."""
    body = {"max_tokens": 24, "guided_choice": ["日本語"], "temperature": 0}
    chat = post(server, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "Hi"}],
                                                 "logprobs": True, "top_logprobs": 2}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert chat["message"]["content"] == "日本語" and any(t["token"] == "\ufffd" for t in content)
    assert b"".join(bytes(t["bytes"]) for t in content) == "日本語<|im_end|>".encode()    # (the end token's text)
    assert all(top["bytes"] for t in content for top in t["top_logprobs"])
    done = post(server, "/v1/completions", {**body, "prompt": "Hi", "logprobs": 1}).json()["choices"][0]
    offsets = done["logprobs"]["text_offset"]
    assert done["text"] == "日本語" and len(offsets) == len(content)
    assert offsets[0] == 0 and offsets == sorted(offsets) and set(offsets[:-1]) <= {0, 1, 2} and offsets[-1] == 3
    streamed = []
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers, timeout=30,
                      json={**body, "prompt": "Hi", "logprobs": 1, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                streamed += choice["logprobs"]["text_offset"] if choice["logprobs"] else []
    assert streamed == offsets


def test_response_format_on_completions(server):
    done = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 40, "temperature": 0,
                                            "response_format": {"type": "json_schema", "json_schema": {
                                                "name": "a", "schema": {"enum": ["yes", "no"]}}}})
    assert done.status_code == 200 and done.json()["choices"][0]["text"] in ('"yes"', '"no"'), done.text


def test_one_model_by_name(server):
    card = httpx.get(server.url + "/v1/models/demo", headers=server.headers).json()
    assert card["id"] == "demo" and card["object"] == "model"
    error = assert_error(httpx.get(server.url + "/v1/models/gpt-9", headers=server.headers), 404, param="model")
    assert error["code"] == "model_not_found"


def test_chat_fields_vllm_and_openai_clients_send(server):
    """The developer role is the system role for a template without one; ``continue_final_message``
    leaves the last message open; a prompt over the limit is the messages' fault."""
    def rendered(messages, **kw):
        tokens = post(server, "/tokenize", {"messages": messages, **kw}).json()["tokens"]
        return post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]

    user = {"role": "user", "content": "Hi"}
    assert rendered([{"role": "developer", "content": "Be brief."}, user]) == \
        rendered([{"role": "system", "content": "Be brief."}, user])
    opened = rendered([user, {"role": "assistant", "content": "The answer is"}], add_generation_prompt=False,
                      continue_final_message=True)
    assert opened.endswith("The answer is")
    both = post(server, "/v1/chat/completions", {"messages": [user, {"role": "assistant", "content": "The"}],
                                                 "continue_final_message": True, "max_tokens": 2})
    assert_error(both, 400, param="continue_final_message")
    effort = post(server, "/v1/chat/completions", {"messages": [user], "max_tokens": 2, "reasoning_effort": "low"})
    assert effort.status_code == 200, effort.text     # a template variable: the demo's template ignores it
    assert_error(post(server, "/v1/chat/completions", {"messages": [user], "reasoning_effort": "max"}), 400,
                 param="reasoning_effort")
    long = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "go " * 600}]})
    assert_error(long, 400, param="messages")
    assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, param="messages")


def test_continuous_usage_stats(server):
    body = {"prompt": "A class definition", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers, timeout=30, json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"] is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 6
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] > 0 for c in chunks)
