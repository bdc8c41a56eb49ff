"""A chat choice's text read by the parsers a server (or an `LLM`) was started with.

The reasoning parser reads the text first; the tool parser reads what it leaves as the answer.
`ChatParsers` holds the two specs chosen by name at startup and makes a fresh `ChoiceParser` per
choice; `parse_whole` is a non-streamed answer read the same way a stream is (one ``feed``, then
``end``), so the two agree by construction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fdplug.plugin_api.parsers import (
    ParserContext,
    ReasoningParser,
    ReasoningParserSpec,
    ToolCallDelta,
    ToolParser,
    ToolParserSpec,
)

logger = logging.getLogger("fdplug")


@dataclass(slots=True)
class ChatDelta:
    """What some of a choice's text adds: reasoning, answer text, and tool calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: ChatDelta) -> ChatDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


class ChoiceParser:
    """One choice: reasoning first (if a reasoning parser is on), then tool calls in the answer."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning, self.tools = reasoning, tools
        self.failed = False

    def feed(self, text: str) -> ChatDelta:
        return self._guarded(text, end=False)

    def end(self) -> ChatDelta:
        return self._guarded("", end=True)

    def _guarded(self, text: str, end: bool) -> ChatDelta:
        """A parser that raises (a plugin's bug, a model's pathological output) is switched off: the
        text goes on as plain content, and the answer is served, never a 500."""
        if self.failed:
            return ChatDelta(content=text)
        try:
            if self.reasoning is None:
                return self._answer(text, end)
            part = self.reasoning.end() if end else self.reasoning.feed(text)
            return ChatDelta(reasoning=part.reasoning).add(self._answer(part.content, end))
        except Exception:  # noqa: BLE001 -- any parser's failure is contained to this choice
            logger.exception("an output parser failed; the rest of this answer is plain content")
            self.failed = True
            return ChatDelta(content=text)

    def _answer(self, text: str, end: bool) -> ChatDelta:
        if self.tools is None:
            return ChatDelta(content=text)
        found = self.tools.feed(text) if text else None
        out = ChatDelta() if found is None else ChatDelta(content=found.content, calls=list(found.calls))
        if end:
            rest = self.tools.end()
            out.add(ChatDelta(content=rest.content, calls=list(rest.calls)))
        return out


@dataclass(frozen=True, slots=True)
class ChatParsers:
    """The reasoning and tool parsers chosen at startup (`fdplug.core.plugin_loading.selection.select_parsers`)."""

    reasoning: ReasoningParserSpec | None = None
    tools: ToolParserSpec | None = None

    def choice(self, context: ParserContext, with_tools: bool) -> ChoiceParser | None:
        """A fresh parser for one choice; None when nothing is parsed (plain content)."""
        reasoning = self.reasoning.factory(context) if self.reasoning is not None else None
        tools = self.tools.factory(context) if self.tools is not None and with_tools else None
        return None if reasoning is None and tools is None else ChoiceParser(reasoning, tools)


def parse_whole(parser: ChoiceParser, text: str) -> ChatDelta:
    """A whole answer, read exactly as a stream of one piece."""
    return parser.feed(text).add(parser.end())


def openai_call(call: ToolCallDelta, streamed: bool = False) -> dict:
    """A parsed call as OpenAI shapes it (with its ``index`` in a stream, where a call's later
    fragments carry only their arguments)."""
    if not streamed:
        return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    head = {"id": call.id, "type": "function"} if call.id is not None else {}
    function = {"name": call.name, "arguments": call.arguments} if call.name is not None else \
        {"arguments": call.arguments}
    return {"index": call.index, **head, "function": function}


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason of a choice that made tool calls: "tool_calls" where it stopped."""
    return "tool_calls" if called and reason == "stop" else reason
