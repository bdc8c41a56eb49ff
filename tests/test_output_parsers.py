"""Reasoning and tool-call parsers (`fdplug.core.parsers`), registered as plugins are.

Every case is read whole and streamed at every split point (and character by character): the
parts must be the same, since a tag or a JSON value may be cut anywhere by the detokenizer.
"""

from __future__ import annotations

import json
import random

import pytest

import fdplug
from fdplug.core.parsers.chat_output import ChatDelta, ChatParsers, parse_whole
from fdplug.core.plugin_loading.selection import select_parsers
from fdplug.errors import ConfigError
from fdplug.plugin_api.parsers import ParserContext

PLUGINS = fdplug.load_plugins()


def parsers(reasoning: str | None = None, tools: str | None = None) -> ChatParsers:
    return select_parsers(PLUGINS, reasoning, tools)


def read(chosen: ChatParsers, pieces: list[str], prompt: str = "", tools: tuple = ()) -> tuple[str, str, list]:
    """(reasoning, content, [(name, arguments)]) of one choice fed ``pieces``."""
    parser = chosen.choice(ParserContext(prompt=prompt, tools=tools), with_tools=chosen.tools is not None)
    out = ChatDelta()
    for piece in pieces:
        out.add(parser.feed(piece))
    out.add(parser.end())
    assert [c.index for c in out.calls] == list(range(len(out.calls)))
    assert all(c.id and c.id.startswith("call_") for c in out.calls)
    return out.reasoning, out.content, [(c.name, json.loads(c.arguments)) for c in out.calls]


def splits(text: str, seed: int = 0):
    """Every split in two, every character alone, and a few random multi-way splits."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 5)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def check_every_split(chosen: ChatParsers, text: str, want: tuple, prompt: str = "", tools: tuple = ()) -> None:
    for pieces in splits(text):
        assert read(chosen, pieces, prompt, tools) == want, pieces


# -- reasoning ----------------------------------------------------------------------------------------

THINK = "<think>\nThe capital of France... Paris.\n</think>\n\nThe capital of France is Paris."


@pytest.mark.parametrize("name", ["qwen3", "glm45"])
def test_a_model_that_opens_its_reasoning(name):
    chosen = parsers(name)
    check_every_split(chosen, THINK, ("\nThe capital of France... Paris.\n", "The capital of France is Paris.", []))
    check_every_split(chosen, "Paris.", ("", "Paris.", []))                     # thinking off: all content
    check_every_split(chosen, "Use <think> tags.", ("", "Use <think> tags.", []))   # a tag after text is text


@pytest.mark.parametrize("name", ["qwen3", "glm45", "deepseek_r1", "ernie"])
def test_reasoning_opened_by_the_template_cut_off_and_split(name):
    chosen = parsers(name)
    opened = "<|im_start|>assistant\n<think>\n"
    check_every_split(chosen, "Hmm, 2+2.\n</think>\n\n4", ("Hmm, 2+2.\n", "4", []), prompt=opened)
    check_every_split(chosen, "<think>\nstill thinking when max_tokens cut it", (
        "\nstill thinking when max_tokens cut it", "", []))
    check_every_split(chosen, "Hmm.</think>", ("Hmm.", "", []), prompt=opened)


def test_a_think_tag_in_the_conversation_does_not_open_the_reasoning():
    chosen = parsers("qwen3", "hermes")
    prompt = "<|im_start|>user\nWhat is the <think> tag for?<|im_end|>\n<|im_start|>assistant\n"
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    check_every_split(chosen, "It marks reasoning." + call, ("", "It marks reasoning.", [("f", {})]), prompt=prompt)


def test_deepseek_r1_reasons_first_with_or_without_its_tag():
    chosen = parsers("deepseek_r1")
    check_every_split(chosen, "Hmm.\n</think>\nParis", ("Hmm.\n", "Paris", []))
    check_every_split(chosen, "<think>Hmm.</think>Paris", ("Hmm.", "Paris", []))


def test_ernie_answer_wrapped_in_response_tags():
    chosen = parsers("ernie")
    check_every_split(chosen, "abc\n</think>\n\n<response>\ndef\n</response>\n", ("abc\n", "def", []))
    check_every_split(chosen, "abc\n</think>\ndef", ("abc\n", "def", []))


# -- tool calls ---------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


def test_hermes_calls_with_text_before_them_and_a_malformed_one_as_text():
    chosen = parsers(tools="hermes")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>')
    check_every_split(chosen, text, ("", "Let me check.", [("get_weather", {"city": "Paris", "days": 2}),
                                                           ("get_weather", {"city": "Zürich"})]))
    broken = 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> done'
    check_every_split(chosen, broken, ("", broken, []))
    unclosed = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n'   # stopped at EOS
    check_every_split(chosen, unclosed, ("", "", [("get_weather", {"city": "Oslo"})]))
    check_every_split(chosen, "No call here, <b>bold</b>.", ("", "No call here, <b>bold</b>.", []))


def test_odd_model_output_is_text_never_an_error():
    chosen = parsers("qwen3", "hermes")
    deep = "<tool_call>" + "[" * 5000 + "</tool_call>"
    assert read(chosen, [deep]) == ("", deep, [])
    nan = '<tool_call>{"name": "f", "arguments": {"v": NaN}}</tool_call>'
    assert read(chosen, [nan]) == ("", nan, [])
    assert read(chosen, ['<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>']) == ("", "", [("f", {"a": 1})])
    glm = "<tool_call>f\n" + "<arg_key>a</arg_key><arg_value>x" * 3000 + "</tool_call>"   # linear, not cubic
    assert read(parsers(tools="glm45"), [glm]) == ("", glm, [])


def test_a_parser_that_raises_leaves_the_rest_of_the_answer_as_plain_content():
    from fdplug.core.parsers.chat_output import ChoiceParser

    class Broken:
        def feed(self, text):
            raise RuntimeError("a plugin's bug")

        def end(self):
            raise RuntimeError("a plugin's bug")

    parser = ChoiceParser(None, Broken())
    out = parser.feed("Hello ").add(parser.feed("world")).add(parser.end())
    assert (out.content, out.calls) == ("Hello world", [])


def test_glm45_arguments_typed_by_the_tools_schema():
    chosen = parsers(tools="glm45")
    text = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
    check_every_split(chosen, text, ("", "", [("get_weather", {"city": "42", "days": 3})]), tools=(WEATHER,))


def test_llama3_json_calls_or_plain_text():
    chosen = parsers(tools="llama3_json")
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
            '{"name": "get_weather", "parameters": {"city": "Bern"}}')
    check_every_split(chosen, text, ("", "", [("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Bern"})]))
    check_every_split(chosen, "It is sunny.", ("", "It is sunny.", []))
    check_every_split(chosen, '{"not": "a call"}', ("", '{"not": "a call"}', []))


def test_reasoning_then_a_call_in_the_answer():
    chosen = parsers("qwen3", "hermes")
    text = '<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    check_every_split(chosen, text, ("\nNeed the weather.\n", "", [("get_weather", {})]))
    whole = parse_whole(chosen.choice(ParserContext(), with_tools=True), text)
    assert whole.content == "" and len(whole.calls) == 1


def test_unknown_parser_names_are_config_errors_naming_the_known_ones():
    with pytest.raises(ConfigError, match="qwen3"):
        parsers("nope")
    with pytest.raises(ConfigError, match="hermes"):
        parsers(tools="nope")
    assert parsers().choice(ParserContext(), with_tools=True) is None
