"""Logprobs as the OpenAI API returns them: the legacy completions shape (parallel lists, top
alternatives by text, ``text_offset``) and the chat shape (one object per token with its bytes).

A token's ``bytes`` are its own (`fdplug.core.frontend.outputs.Logprob.token_bytes`, from the
vocabulary): a byte-level token that holds part of a character decodes alone to U+FFFD, and its
bytes joined with its neighbours' are the character, which is what the field is for.
"""

from __future__ import annotations

import codecs
from typing import Any


def _top(entry: dict, k: int) -> list:
    return sorted(entry.items(), key=lambda item: item[1].rank)[:k]


class TextOffsets:
    """One choice's ``text_offset``: the characters before each token, its bytes decoded as UTF-8
    one token at a time (a token that holds part of a character adds none until the character is
    whole, as the text itself shows it). Kept across a stream's chunks."""

    __slots__ = ("chars", "decoder")

    def __init__(self) -> None:
        self.chars = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, token_bytes: bytes) -> int:
        at = self.chars
        self.chars += len(self.decoder.decode(token_bytes))
        return at


def completion_logprobs(token_ids: list[int], entries: list[dict], k: int, offsets: TextOffsets | None = None) -> dict:
    """The legacy completions shape: parallel lists, top alternatives as {token: logprob}."""
    offsets = offsets or TextOffsets()
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        sampled = entry.get(tid)
        tokens.append(sampled.decoded_token if sampled is not None else "")
        token_logprobs.append(sampled.logprob if sampled is not None else None)
        top_logprobs.append(_top_by_text(entry, k) if k else None)
        text_offset.append(offsets.next(_bytes(sampled)))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def _bytes(lp: Any) -> bytes:
    """A candidate's own bytes (its text's where a caller gave none)."""
    if lp is None:
        return b""
    return lp.token_bytes if lp.token_bytes is not None else (lp.decoded_token or "").encode("utf-8", "replace")


def _top_by_text(entry: dict, k: int) -> dict[str, float]:
    """{text: logprob} of the top ``k``; byte pieces that decode alike keep the likeliest one's logprob."""
    top: dict[str, float] = {}
    for _, lp in _top(entry, k):     # most likely first
        top.setdefault(lp.decoded_token, lp.logprob)
    return top


def chat_logprobs(token_ids: list[int], entries: list[dict], k: int) -> dict:
    """The chat shape: one object per token, with its bytes and its top alternatives."""
    content = []
    for tid, entry in zip(token_ids, entries):
        sampled = entry.get(tid)
        content.append({
            "token": sampled.decoded_token if sampled is not None else "",
            "logprob": sampled.logprob if sampled is not None else None, "bytes": list(_bytes(sampled)),
            "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(_bytes(lp))}
                             for _, lp in _top(entry, k)]})
    return {"content": content, "refusal": None}
