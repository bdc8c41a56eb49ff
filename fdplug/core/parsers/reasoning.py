"""The built-in reasoning parsers: thinking between ``<think>`` and ``</think>``, and its variants.

Every family fdplug runs marks its reasoning with the same two tags; they differ in who opens it
and in what wraps the answer:

- ``qwen3`` and ``glm45``: the model opens the reasoning itself, as the first thing it writes
  (``<think>...</think>answer``); without the tag the whole answer is content (thinking switched
  off: the template closed an empty reasoning in the prompt);
- ``deepseek_r1``: the reasoning comes first whether or not the model writes ``<think>`` (its
  template opens it); everything before ``</think>`` is reasoning;
- ``ernie``: ERNIE-4.5 thinking, like ``deepseek_r1``, its answer optionally wrapped in
  ``<response>...</response>`` (``abc</think>\\n\\n<response>\\ndef\\n</response>``).

For all of them a template that opens the reasoning in the prompt (the prompt ends with ``<think>``)
starts the output in the reasoning. Rules the tests hold for every split of the text:
a start tag counts only before any answer text (a model writing about ``<think>`` later is just
text); whitespace between the reasoning and the answer is dropped; an output cut off inside its
reasoning (``max_tokens``) is all reasoning and no tag ever reaches the content.
"""

from __future__ import annotations

from dataclasses import dataclass

from fdplug.core.model.text.detokenizer import held_prefix
from fdplug.plugin_api.parsers import ParserContext, ReasoningDelta, ReasoningParserSpec

START, END = "<think>", "</think>"
_BEFORE, _REASONING, _CONTENT = "before", "reasoning", "content"


def opened_in(prompt: str, start: str = START) -> bool:
    """Whether the template opened the reasoning: the prompt ends with the start tag (a ``<think>``
    anywhere else, in a user's message or a tool's result, is text)."""
    return prompt.rstrip().endswith(start)


@dataclass(frozen=True, slots=True)
class ThinkTags:
    """One family's variant: whether the reasoning comes first, and the answer's optional wrapper."""

    reasoning_first: bool = False
    answer_open: str = ""     # e.g. "<response>": dropped where the answer starts
    answer_close: str = ""    # e.g. "</response>": dropped, and what follows it when only whitespace


class ThinkParser:
    """One choice's text -> reasoning and answer (`fdplug.plugin_api.parsers.ReasoningParser`).

    A state machine over the text held so far: before the reasoning (where only whitespace and the
    start tag may come first), in it (until the end tag), in the answer. ``leading`` marks the start
    of a part, where whitespace and an opening tag are held until the next character decides.
    """

    def __init__(self, tags: ThinkTags, context: ParserContext) -> None:
        self.tags = tags
        self.state = _REASONING if tags.reasoning_first or opened_in(context.prompt) else _BEFORE
        self.leading = True
        self.answer_opened = False
        self.buffer = ""

    def feed(self, text: str) -> ReasoningDelta:
        self.buffer += text
        out = ReasoningDelta()
        while self.buffer and self._advance(out):
            pass
        return out

    def end(self) -> ReasoningDelta:
        rest, self.buffer = self.buffer, ""
        if self.state == _REASONING:
            return ReasoningDelta(reasoning=rest)
        if self.state == _BEFORE or self.leading:
            return ReasoningDelta(content=rest.strip())
        return ReasoningDelta(content=rest.rstrip())    # held: trailing whitespace, part of a closing tag

    def _lead(self, tag: str) -> bool | None:
        """At the start of a part: True (``tag`` was there: consumed, with the whitespace before it),
        False (it is not), None (not known yet)."""
        stripped = self.buffer.lstrip()
        if not stripped:
            return None
        if stripped.startswith(tag):
            self.buffer = stripped[len(tag):]
            return True
        return None if tag.startswith(stripped) else False

    def _advance(self, out: ReasoningDelta) -> bool:
        """One move; False when the machine must wait for more text."""
        if self.state == _BEFORE:
            opened = self._lead(START)
            if opened is None:
                return False
            self.state, self.leading = (_REASONING, False) if opened else (_CONTENT, True)
            return True
        if self.state == _REASONING:
            return self._reasoning(out)
        return self._answer(out)

    def _reasoning(self, out: ReasoningDelta) -> bool:
        if self.leading:        # the model may write the tag its template (or its family) opened
            if self._lead(START) is None:
                return False
            self.leading = False
        i = self.buffer.find(END)
        if i >= 0:
            out.reasoning += self.buffer[:i]
            self.buffer = self.buffer[i + len(END):]
            self.state, self.leading = _CONTENT, True
            return True
        self._emit(out, "reasoning", held_prefix(self.buffer, (END,)))
        return False

    def _answer(self, out: ReasoningDelta) -> bool:
        if self.leading:
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return False
            if self.tags.answer_open and not self.answer_opened:
                opened = self._lead(self.tags.answer_open)
                if opened is None:
                    return False
                self.answer_opened = True
                return True     # (what follows the wrapper's tag is leading too)
            self.leading = False
        close = self.tags.answer_close
        if not close:
            self._emit(out, "content", 0)
            return False
        i = self.buffer.find(close)
        if i >= 0:
            out.content += self.buffer[:i].rstrip()
            self.buffer = self.buffer[i + len(close):]
            return True
        tag = held_prefix(self.buffer, (close,))
        before = self.buffer[:len(self.buffer) - tag]
        self._emit(out, "content", tag + len(before) - len(before.rstrip()))   # whitespace before the tag: held
        return False

    def _emit(self, out: ReasoningDelta, part: str, keep: int) -> None:
        """All but the last ``keep`` characters of the buffer go to ``part``."""
        cut = len(self.buffer) - keep
        setattr(out, part, getattr(out, part) + self.buffer[:cut])
        self.buffer = self.buffer[cut:]


FAMILIES = {
    "qwen3": (ThinkTags(), "Qwen3: <think>...</think> first in the answer, if the model thinks"),
    "glm45": (ThinkTags(), "GLM-4.5: <think>...</think> first in the answer, if the model thinks"),
    "deepseek_r1": (ThinkTags(reasoning_first=True), "DeepSeek-R1: everything before </think> is reasoning"),
    "ernie": (ThinkTags(reasoning_first=True, answer_open="<response>", answer_close="</response>"),
              "ERNIE-4.5 thinking: reasoning before </think>, the answer optionally in <response>...</response>"),
}


def reasoning_specs() -> list[ReasoningParserSpec]:
    return [ReasoningParserSpec(name, (lambda context, tags=tags: ThinkParser(tags, context)), description, END)
            for name, (tags, description) in FAMILIES.items()]
