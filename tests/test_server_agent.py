"""What agents send, through the real server and the official ``openai`` client: tools and tool
calls, reasoning content, ``/tokenize`` and ``/detokenize``.

The model is the demo's (its ChatML template renders tools the Qwen way) run by a scripted runner
(``tests/scripted_plugin.py``): whatever the prompt, it says exactly ``SCRIPT``, a Qwen3-style
answer with reasoning, text and two calls, token by token. Streamed and whole answers must agree.
"""

from __future__ import annotations

import json
import sys

import httpx
import pytest

from fdplug.core.model.text.tokenizer import Tokenizer
from fdplug.demo import DEMO_MODEL_DIR
from fdplug.errors import InvalidRequestError
from fdplug.plugin_api.sampling_params import SamplingParams
from tests.conftest import REPO, write_dist
from tests.serverkit import Server

SCRIPT = ('<think>\nThe user wants the weather in Zürich and Oslo.\n</think>\n\nLet me check both.\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
REASONING = "\nThe user wants the weather in Zürich and Oslo.\n"
CALLS = [("get_weather", {"city": "Zürich", "days": 2}), ("get_weather", {"city": "Oslo"})]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Zürich and Oslo?"}]


def script_tokens() -> list[int]:
    tokenizer = Tokenizer.from_dir(str(DEMO_MODEL_DIR))
    ids = tokenizer.encode(SCRIPT, add_special_tokens=False)
    assert tokenizer.decode(ids) == SCRIPT
    return [*ids, tokenizer.eos_token_ids[0]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    write_dist(site, "fdplug-scripted", "0.1", {"scripted": "tests.scripted_plugin"})
    srv = Server(["--runner", "scripted", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                  "--tool-call-parser", "hermes", "--max-model-len", "1024"],
                 tmp_path_factory.mktemp("log") / "server.log",
                 SCRIPTED_TOKENS=json.dumps(script_tokens()), PYTHONPATH=f"{site}:{REPO}")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or []]


def test_a_whole_answer_has_its_reasoning_content_and_calls(server):
    out = server.openai().chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check both."
    assert choice.message.model_extra["reasoning_content"] == REASONING
    assert calls_of(choice.message.tool_calls) == CALLS
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)


def test_a_streamed_answer_gives_the_same_parts(server):
    stream = server.openai().chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                     stream=True)
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert "<think>" not in (delta.content or "") and "<tool_call>" not in (delta.content or "")
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == (REASONING, "Let me check both.", "tool_calls")
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == CALLS


def test_parallel_tool_calls_false_keeps_the_first_call(server):
    client = server.openai()
    out = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                         parallel_tool_calls=False)
    assert calls_of(out.choices[0].message.tool_calls) == CALLS[:1]
    streamed = [call for chunk in client.chat.completions.create(
        model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=200, parallel_tool_calls=False, stream=True)
        for call in chunk.choices[0].delta.tool_calls or []]
    assert [c.index for c in streamed] == [0]


def test_without_tools_the_calls_stay_text_and_max_tokens_cuts_the_reasoning(server):
    client = server.openai()
    out = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=200)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.tool_calls in (None, [])
    assert out.choices[0].message.content.startswith("Let me check both.\n<tool_call>")
    cut = client.chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=6)
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.content
    assert cut.choices[0].message.model_extra["reasoning_content"]
    assert "<think>" not in cut.choices[0].message.model_extra["reasoning_content"]


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "not_offered"}}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice"),
    ({"tool_choice": {"function": None}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools.0.function.parameters"),
    ({"tools": None, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
])
def test_tool_requests_it_cannot_honour_are_400s_naming_the_field(server, body, param):
    response = post(server, "/v1/chat/completions", {"model": "demo", "messages": MESSAGES, "tools": TOOLS, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_tokenize_counts_what_a_request_reports_and_detokenize_inverts_it(server):
    usage = server.openai().chat.completions.create(model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=1).usage
    chat = post(server, "/tokenize", {"model": "demo", "messages": MESSAGES, "tools": TOOLS}).json()
    assert chat["count"] == usage.prompt_tokens == len(chat["tokens"]) and chat["max_model_len"] == 1024
    plain = post(server, "/tokenize", {"prompt": "Hello, Zürich!", "return_token_strs": True}).json()
    assert plain["count"] == len(plain["token_strs"]) > 0
    assert post(server, "/detokenize", {"tokens": plain["tokens"]}).json() == {"prompt": "Hello, Zürich!"}
    long = post(server, "/tokenize", {"prompt": "word " * 1500}).json()      # counted, not refused
    assert long["count"] > long["max_model_len"] == 1024
    deep = httpx.post(server.url + "/tokenize", content=b"[" * 100000, timeout=30)
    assert deep.status_code == 400
    bad = post(server, "/detokenize", {"tokens": [10 ** 9]})
    assert bad.status_code == 400 and "vocab" in bad.json()["error"]["message"]
    assert post(server, "/tokenize", {"prompt": "x", "model": "other"}).status_code == 404


def test_llm_chat_reads_reasoning_and_calls_too(tmp_path, monkeypatch):
    from fdplug.core.frontend.llm import LLM
    from fdplug.core.plugin_loading import loader
    from tests import scripted_plugin

    write_dist(tmp_path, "fdplug-scripted", "0.1", {"scripted": "tests.scripted_plugin"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(scripted_plugin, "SCRIPT", script_tokens())
    loader._cache.clear()
    try:
        llm = LLM(runner="scripted", reasoning_parser="qwen3", tool_call_parser="hermes", max_model_len=1024)
        out = llm.chat(MESSAGES, SamplingParams(max_tokens=200), tools=TOOLS, use_tqdm=False)[0].outputs[0]
        assert out.text == SCRIPT and out.content == "Let me check both." and out.reasoning_content == REASONING
        assert out.finish_reason == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls] == CALLS
        with pytest.raises(InvalidRequestError, match="cannot hold"):    # a runner that does not say it can
            llm.generate(["x"], SamplingParams(structured_outputs={"regex": "a+"}), use_tqdm=False)
    finally:
        loader._cache.clear()
        sys.modules.pop("fdplug_scripted", None)


def test_with_a_reasoning_parser_an_output_constraint_waits_for_the_end_tag():
    from types import SimpleNamespace

    from fdplug.core.plugin_loading.selection import select_parsers
    from fdplug.server.api.jobs import JobBuilder

    tokenizer = Tokenizer.from_dir(str(DEMO_MODEL_DIR))
    client = SimpleNamespace(tokenizer=tokenizer)
    thinking = JobBuilder(client, "demo", parsers=select_parsers(fdplug_plugins(), "qwen3"))
    held = SamplingParams(structured_outputs={"json_object": True})
    assert thinking.after_reasoning(held).reasoning_end_token_ids == tuple(
        tokenizer.encode("</think>", add_special_tokens=False))
    assert thinking.after_reasoning(SamplingParams()).reasoning_end_token_ids == ()
    assert JobBuilder(client, "demo").after_reasoning(held).reasoning_end_token_ids == ()


def fdplug_plugins():
    import fdplug

    return fdplug.load_plugins()
