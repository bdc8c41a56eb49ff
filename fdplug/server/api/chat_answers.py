"""A chat choice as the API returns it, read by the parsers the server was started with.

With ``--reasoning-parser`` the answer's reasoning goes to ``reasoning_content``; with tools and
``--tool-call-parser`` the model's calls go to ``tool_calls`` and the choice finishes with
"tool_calls" (`fdplug.core.parsers`). A whole answer is read as a stream of one piece, so the
message and the deltas of the same text agree. Without parsers the text is the content, as is.
"""

from __future__ import annotations

from typing import Any

from fdplug.core.frontend.processor import Delta
from fdplug.core.parsers.chat_output import ChoiceParser, finish_reason, openai_call, parse_whole
from fdplug.server.api import openai_types as T
from fdplug.server.api.jobs import Job


def chat_message_choice(job: Job, index: int, text: str, reason: str | None, logprobs: dict | None,
                        stop_reason: int | str | None = None) -> dict:
    """A whole choice: its message."""
    parser = job.parse() if job.parse is not None else None
    if parser is None:
        return T.chat_choice(index, text, reason, logprobs, stop_reason=stop_reason)
    answer = parse_whole(parser, text)
    calls = [openai_call(call) for call in answer.calls if not job.one_call or call.index == 0]
    return T.chat_choice(index, answer.content or (None if calls else ""), finish_reason(reason, bool(calls)),
                         logprobs, answer.reasoning, calls, parser.reasoning is not None, stop_reason)


class ChatDeltas:
    """A streamed job's chat deltas: per choice, the parser reading its text and whether it called a tool."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.parsers: dict[tuple[str, int], ChoiceParser | None] = {}
        self.called: set[tuple[str, int]] = set()

    def delta(self, key: tuple[str, int], delta: Delta) -> tuple[dict, str | None]:
        """The chunk's ``delta`` and finish reason for one choice: what its text adds to the reasoning,
        the answer and the calls (text a parser holds, e.g. half a tag, waits for the next chunk)."""
        finish = delta.finish_reason
        if key not in self.parsers:
            self.parsers[key] = self.job.parse() if self.job.parse is not None else None
        parser = self.parsers[key]
        if parser is None:
            return ({"content": delta.text} if delta.text or finish is None else {}), finish
        part = parser.feed(delta.text)
        if finish is not None:
            part.add(parser.end())
        body: dict[str, Any] = {}
        if part.reasoning:
            body["reasoning_content"] = part.reasoning
        if part.content:
            body["content"] = part.content
        calls = [call for call in part.calls if not self.job.one_call or call.index == 0]
        if calls:
            body["tool_calls"] = [openai_call(call, streamed=True) for call in calls]
            self.called.add(key)
        return body, finish_reason(finish, key in self.called)
