"""Output parsers: a chat answer's reasoning and its tool calls, read out of the generated text.

A thinking model writes its reasoning before its answer (``<think>...</think>`` and kin), and a
model asked to call tools writes the calls in its own format (``<tool_call>{...}</tool_call>``, a
bare JSON object, ...). A *reasoning parser* splits a choice's text into ``reasoning_content`` and
``content``; a *tool parser* finds the calls in ``content``. Both are named by the user
(``fdplug serve --reasoning-parser NAME --tool-call-parser NAME``, ``LLM(reasoning_parser=...)``),
registered by plugins (`fdplug_register_reasoning_parsers`, `fdplug_register_tool_parsers`; the
core's own the same way), and run in the API process (and in `LLM.chat`) on the detokenized text.

One contract for streamed and whole answers: a parser is made per choice (``factory(context)``),
fed the text as it arrives (``feed``, any split: a tag or a JSON value may be cut anywhere) and told
when it ends (``end``); the parts it returns, concatenated, are the same whatever the split. A
parser holds back text that may be the start of a tag until it knows. A whole answer is one
``feed`` and the ``end``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ParserContext:
    """What a parser knows about the choice it reads: the rendered prompt (a template may open the
    reasoning itself: ``...<think>\\n``), the tools offered, and the template's variables
    (``enable_thinking``)."""

    prompt: str = ""
    tools: Sequence[Mapping[str, Any]] = ()
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ReasoningDelta:
    """What some text adds to the reasoning and to the answer."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser(Protocol):
    """Splits one choice's text into reasoning and answer."""

    def feed(self, text: str) -> ReasoningDelta:
        """The parts ``text`` adds (text that may begin a tag is held until the next call)."""

    def end(self) -> ReasoningDelta:
        """The output ended (a stop, or ``max_tokens``: the reasoning may be unclosed): what was held."""


@dataclass(slots=True)
class ToolCallDelta:
    """A part of one call: ``index`` (0, 1, ... in the message), then its ``id`` and ``name`` once,
    and ``arguments`` as JSON text fragments whose concatenation is the call's arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ToolDelta:
    """What some answer text adds: text that is not a call, and parts of calls."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser(Protocol):
    """Finds the tool calls in one choice's answer; a malformed call is returned as text, never raised."""

    def feed(self, text: str) -> ToolDelta:
        """The parts ``text`` adds (a call is held until it is complete enough to be sure of it)."""

    def end(self) -> ToolDelta:
        """The answer ended: what was held (an unfinished call is text)."""


@dataclass(frozen=True, slots=True)
class ReasoningParserSpec:
    """A reasoning parser: ``factory(context)`` returns a fresh `ReasoningParser` for one choice.

    ``end_tag``: the text that ends the reasoning, when it is a fixed one (``</think>``): a
    structured-output constraint then holds the answer after it, not the reasoning."""

    name: str
    factory: Callable[[ParserContext], ReasoningParser]
    description: str = ""
    end_tag: str = ""

    role = "reasoning_parser"


@dataclass(frozen=True, slots=True)
class ToolParserSpec:
    """A tool-call parser: ``factory(context)`` returns a fresh `ToolParser` for one choice."""

    name: str
    factory: Callable[[ParserContext], ToolParser]
    description: str = ""

    role = "tool_parser"
