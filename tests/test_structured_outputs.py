"""Structured outputs (`fdplug.core.structured`): outputs held to a JSON schema, a regex, a choice.

On the demo model, sampled at temperature 1 with seeds (so the model would wander off on its own),
through a KV cache small enough that requests are preempted and resumed (their matchers replayed).
"""

from __future__ import annotations

import json
import re

import pytest

import fdplug
from fdplug.errors import InvalidRequestError
from fdplug.plugin_api.sampling_params import SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}}}


def conforms(value) -> bool:
    """The schema above, checked by hand (no jsonschema dependency)."""
    return (isinstance(value, dict) and set(value) == {"name", "age", "tags"}
            and isinstance(value["name"], str) and 1 <= len(value["name"]) <= 12
            and type(value["age"]) is int and 0 <= value["age"] <= 150
            and isinstance(value["tags"], list) and len(value["tags"]) <= 3
            and all(t in ("a", "b", "c") for t in value["tags"]))


@pytest.fixture(scope="module")
def llm():
    return fdplug.LLM(max_model_len=256, num_kv_blocks=48, max_num_seqs=32)


def test_64_seeded_requests_all_give_json_of_the_schema_through_preemption(llm):
    before = llm.engine.scheduler.num_preemptions
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs={"json": SCHEMA})
              for i in range(64)]
    outs = llm.generate([f"Person {i}: " for i in range(64)], params, use_tqdm=False)
    values = [json.loads(o.outputs[0].text) for o in outs]
    assert all(conforms(v) for v in values) and all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert llm.engine.scheduler.num_preemptions > before     # resumed requests replayed their matchers
    assert len({json.dumps(v) for v in values}) > 8          # sampled, not one forced answer


def test_unconstrained_requests_give_the_same_tokens_beside_constrained_ones(llm):
    free = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0.9, seed=5, max_tokens=24)]
    prompts = ["The Python tutorial", "Modules are"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs={"json": SCHEMA})
                   for i in range(6)]
    mixed = llm.generate([*prompts, *[f"p{i}" for i in range(6)]], [*free, *constrained], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone


def test_regex_choice_grammar_and_json_object(llm):
    def text(constraint, max_tokens=40):
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=max_tokens, structured_outputs=constraint)
        out = llm.generate(["Answer: "], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop", out
        return out.text

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text({"regex": "[0-9]{3}-[a-z]{2}"}))
    assert text({"choice": ["yes", "no", "maybe"]}) in ("yes", "no", "maybe")
    sums = text({"grammar": 'start: sum\nsum: "x" | "(" sum "+" sum ")"'})
    while "(x+x)" in sums:          # the grammar's language: reduce innermost sums to one x
        sums = sums.replace("(x+x)", "x")
    assert sums == "x"
    assert isinstance(json.loads(text({"json_object": True}, max_tokens=200)), dict)


def test_a_constraint_that_cannot_finish_within_max_tokens_ends_with_length(llm):
    out = llm.generate(["x"], SamplingParams(max_tokens=5, structured_outputs={"regex": "[a-z]{200}"}),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and re.fullmatch("[a-z]+", out.text)


@pytest.mark.parametrize("constraint, says", [
    ({"regex": "(unclosed"}, "unclosed group"),
    ({"json": {"type": "strng"}}, "at /type"),
    ({"json": {"properties": {"age": {"type": "int"}}}}, "at /properties/age/type"),
    ({"json": {"items": {"anyOf": [{"required": "x"}]}}}, "at /items/anyOf/0/required"),
    ({"grammar": "start: ???"}, "grammar"),
    ({"choice": []}, "1 to 256"),
    ({"json": "[1"}, "not JSON"),
    ({"xml": "<a/>"}, "must name one of"),
    ({"regex": "a" * 300_000}, "characters"),
])
def test_a_constraint_that_cannot_compile_is_a_typed_error_naming_it(llm, constraint, says):
    with pytest.raises(InvalidRequestError, match=re.escape(says)) as info:
        llm.generate(["x"], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert info.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()


# -- through the server and the official client ----------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.serverkit import Server

    srv = Server(["--max-model-len", "512"], tmp_path_factory.mktemp("log") / "server.log")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_the_openai_client_parses_a_pydantic_model_and_a_stream_agrees(server):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(min_length=1, max_length=12)
        age: int = Field(ge=0, le=150)

    client = server.openai()
    ask = dict(model="demo", messages=[{"role": "user", "content": "A person, please."}], max_tokens=100,
               temperature=1.0, seed=7)
    parsed = client.chat.completions.parse(response_format=Person, **ask).choices[0].message.parsed
    assert isinstance(parsed, Person) and 1 <= len(parsed.name) <= 12
    whole = client.chat.completions.create(response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA, "strict": True}}, **ask).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}, stream=True,
        **ask))
    assert streamed == whole and conforms(json.loads(whole))
    choice = client.completions.create(model="demo", prompt="Yes or no?", max_tokens=5,
                                       extra_body={"guided_choice": ["yes", "no"]}).choices[0].text
    assert choice in ("yes", "no")


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
    ({"structured_outputs": {"regex": "(bad"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[" * 5000}, "guided_json"),
    ({"structured_outputs": {"json": "[" * 5000}}, "structured_outputs"),
])
def test_a_constraint_the_server_cannot_honour_is_a_400_naming_it(server, extra, param):
    import httpx

    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], **extra}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}


def weather_args(arguments: str) -> bool:
    value = json.loads(arguments)
    return set(value) <= {"city", "days"} and isinstance(value.get("city"), str) and 1 <= len(value["city"]) <= 12 \
        and (type(value.get("days", 1)) is int and 1 <= value.get("days", 1) <= 14)


def test_a_named_or_required_tool_choice_always_gives_valid_calls(server):
    client = server.openai()
    ask = dict(model="demo", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, CLOCK],
               max_tokens=80, temperature=1.0)
    for seed in range(4):
        named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                               seed=seed, **ask).choices[0]
        (call,) = named.message.tool_calls
        assert call.function.name == "get_weather" and weather_args(call.function.arguments)
        assert named.finish_reason == "tool_calls" and named.message.content is None
        required = client.chat.completions.create(tool_choice="required", seed=seed, **ask).choices[0]
        assert required.message.tool_calls and required.finish_reason == "tool_calls"
        for call in required.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time")
            assert weather_args(call.function.arguments) if call.function.name == "get_weather" else \
                set(json.loads(call.function.arguments)) <= {"zone"}
    single = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, seed=1, **ask)
    assert len(single.choices[0].message.tool_calls) == 1
    chunks = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            seed=0, stream=True, **ask)
    streamed = "".join(c.choices[0].delta.tool_calls[0].function.arguments or "" for c in chunks
                       if c.choices and c.choices[0].delta.tool_calls)
    whole = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           seed=0, **ask).choices[0].message.tool_calls[0].function.arguments
    assert streamed == whole


def test_a_constraint_behind_a_reasoning_gate_holds_only_what_follows_it(llm):
    """``reasoning_end_token_ids`` (the server sets it to the reasoning parser's end tag): free text
    until the gate token, then the schema; a prompt that ends with the gate is held from the start."""
    newline = 10     # the demo tokenizer's "\n", standing in for a thinking model's "</think>"
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=150, structured_outputs={"json": SCHEMA},
                             reasoning_end_token_ids=[newline]) for i in range(8)]
    outs = llm.generate([f"Notes on module {i}:" for i in range(8)], params, use_tqdm=False)
    for out in outs:
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        assert newline in ids and out.outputs[0].finish_reason == "stop", text
        free = llm.tokenizer.decode(ids[:ids.index(newline) + 1])      # up to the gate (other tokens hold "\n" too)
        assert text.startswith(free) and conforms(json.loads(text[len(free):])) and not free.startswith("{"), text
    opened = llm.generate([{"prompt_token_ids": [80, 403, 263, 58, newline]}], params[0], use_tqdm=False)[0]
    assert conforms(json.loads(opened.outputs[0].text))


def test_llm_chat_forces_a_call_offline():
    llm = fdplug.LLM(max_model_len=1024)      # the tools make the prompt ~420 tokens
    outs = llm.chat([{"role": "user", "content": "Weather?"}], SamplingParams(temperature=1.0, seed=2, max_tokens=80),
                    tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                    use_tqdm=False)
    (call,) = outs[0].outputs[0].tool_calls
    assert call["function"]["name"] == "get_weather" and weather_args(call["function"]["arguments"])
    assert outs[0].outputs[0].finish_reason == "tool_calls" and outs[0].outputs[0].content == ""
    with pytest.raises(InvalidRequestError, match="tool_choice must name"):
        llm.chat([{"role": "user", "content": "x"}], tools=[WEATHER], tool_choice={"function": {"name": "nope"}})


def test_required_tools_with_their_own_defs_and_logprobs_of_masked_tokens():
    """Pydantic writes ``$defs`` + ``#/$defs/X`` refs: they still resolve in the forced calls' schema;
    a token the constraint masked has a finite logprob (JSON has no -Infinity)."""
    llm = fdplug.LLM(max_model_len=1024)
    point = {"type": "function", "function": {"name": "plot", "parameters": {
        "$defs": {"P": {"type": "object", "additionalProperties": False, "required": ["x"],
                        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        "type": "object", "additionalProperties": False, "required": ["p"],
        "properties": {"p": {"$ref": "#/$defs/P"}}}}}
    outs = llm.chat([{"role": "user", "content": "Plot."}], SamplingParams(temperature=1.0, seed=4, max_tokens=60),
                    tools=[point, CLOCK], tool_choice="required", use_tqdm=False)
    for call in outs[0].outputs[0].tool_calls:
        args = json.loads(call["function"]["arguments"])
        assert args == {} or set(args) <= {"zone"} if call["function"]["name"] == "get_time" else \
            set(args) == {"p"} and 0 <= args["p"]["x"] <= 9
    choice = llm.generate(["Pick:"], SamplingParams(max_tokens=4, logprobs=5, structured_outputs={
        "choice": ["red", "blue"]}), use_tqdm=False)[0].outputs[0]
    assert choice.text in ("red", "blue")
    assert all(lp.logprob > float("-inf") for entry in choice.logprobs for lp in entry.values())
    phone = {"type": "object", "properties": {"n": {"type": "string", "format": "phone", "maxLength": 5}},
             "required": ["n"], "additionalProperties": False}
    assert "n" in json.loads(llm.generate(["x"], SamplingParams(max_tokens=30, structured_outputs={"json": phone}),
                                          use_tqdm=False)[0].outputs[0].text)
