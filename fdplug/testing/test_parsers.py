"""Output-parser contract: every registered reasoning and tool parser reads an answer the same way
whole and streamed at any split, holds nothing back at the end, and raises on nothing.

The texts are the families' own shapes and broken ones; a parser's split-independence is what
makes a streamed answer agree with the non-streamed one, whatever the detokenizer's boundaries.
"""

from __future__ import annotations

import pytest

from fdplug.plugin_api.parsers import ParserContext

TEXTS = [
    "Plain answer, no tags at all.",
    "<think>\nreasoning\n</think>\n\nThe answer.",
    "reasoning opened by the template\n</think>\nThe answer.",
    "<think>\ncut off by max_tokens",
    'Text.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    '{"name": "f", "parameters": {"a": [1, 2]}}',
    "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
    '<tool_call>{"name": "f", "arguments": {</tool_call> broken',
    "<" * 40 + "</" * 20 + "{" * 30,
]
TOOLS = ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}}}}},)


def _read(parser, pieces: list[str]) -> tuple:
    parts = [parser.feed(piece) for piece in pieces] + [parser.end()]
    if hasattr(parts[0], "reasoning"):
        return "".join(p.reasoning for p in parts), "".join(p.content for p in parts)
    calls = [c for p in parts for c in p.calls]
    return "".join(p.content for p in parts), [(c.index, c.name, c.arguments) for c in calls]


def _splits(text: str):
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


@pytest.mark.parametrize("role", ["reasoning_parser", "tool_parser"])
def test_every_parser_reads_every_split_alike(fdplug_plugin_set, role):
    entries = fdplug_plugin_set.registry.entries(role)
    if not entries:
        pytest.skip(f"no {role} registered")
    for entry in entries:
        for text in TEXTS:
            for prompt in ("", "<|im_start|>assistant\n<think>\n"):
                context = ParserContext(prompt=prompt, tools=TOOLS)
                whole = _read(entry.spec.factory(context), [text])    # (a call's id is fresh: not compared)
                for pieces in _splits(text):
                    got = _read(entry.spec.factory(context), pieces)
                    assert got == whole, f"{role} {entry.spec.name!r} reads {pieces!r} as {got}, whole as {whole}"
