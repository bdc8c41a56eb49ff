"""Incremental detokenizer: a request's generated ids -> text deltas, with stop strings.

Why incremental: re-decoding the whole output every step is O(length) per token. Here each step
decodes only a short window of ids (the technique of TGI and vLLM):

- ``prefix`` ids (already emitted) are decoded together with the new ids, and the new text is the
  difference. The prefix gives the decoder context: SentencePiece decoders drop the leading space
  of the first token they see, and the first token after the prompt must not lose its space.
- Byte-level BPE can split one character over several tokens; the partial bytes decode to
  U+FFFD. While the window's text ends in U+FFFD nothing is emitted: the ids wait in the window
  until the character is complete (or until ``finish()``, which emits whatever is left).

Stop strings follow OpenAI: the output ends before the first stop string to be completed
(``include_stop_str_in_output`` keeps it), and text that could be the start of a stop string is
held back until the next delta shows whether it is one. Held text is at most
``len(longest stop) - 1`` characters; ``finish()`` releases it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# Prompt ids decoded with the first generated ids, for context (vLLM uses the same number).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def held_prefix(text: str, strings: Sequence[str], longest: int | None = None) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``strings`` (at most
    ``longest``): text to hold until the next piece shows whether it is one (a stop string here, a
    tag for the output parsers, `fdplug.core.parsers`)."""
    if longest is None:
        longest = max((len(s) for s in strings), default=1) - 1
    for length in range(min(longest, len(text)), 0, -1):
        tail = text[-length:]
        if any(s.startswith(tail) for s in strings):
            return length
    return 0


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer (``fdplug.core.model.text.tokenizer.Tokenizer`` has it)."""

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Per-request detokenization state. ``step`` each step's new ids, ``finish`` once at the end.

    After a stop string is found, ``stop_reason`` holds it and ``finished`` is True: the caller
    ends the request (finish reason "stop"); later calls return "".
    """

    tokenizer: Decoder
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    stop_reason: str | None = field(default=None, init=False)
    finished: bool = field(default=False, init=False)
    _window: list[int] = field(default_factory=list, init=False)  # prefix ids, then ids not decoded yet
    _read: int = field(default=0, init=False)  # window[:_read] is the prefix, window[_read:] is pending
    _held: str = field(default="", init=False)  # decoded text held back: it may start a stop string
    _chunks: list[str] = field(default_factory=list, init=False)  # every delta returned, for output_text
    _max_hold: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop  # OpenAI allows a bare string
        self.stop = tuple(dict.fromkeys(s for s in stop if s))  # "" would match everywhere
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1

    @classmethod
    def for_request(cls, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (), *,
                    skip_special_tokens: bool = True, stop: str | Iterable[str] = (),
                    include_stop_str_in_output: bool = False) -> IncrementalDetokenizer:
        """A detokenizer whose first delta is decoded in the context of the prompt's last ids."""
        context = [int(i) for i in prompt_token_ids[max(0, len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS):]]
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        detok = cls(tokenizer, skip_special_tokens, stop, include_stop_str_in_output)
        detok._window = context
        detok._read = len(context)
        return detok

    @property
    def output_text(self) -> str:
        """All text returned so far (held-back text excluded)."""
        return "".join(self._chunks)

    def step(self, new_token_ids: Iterable[int]) -> str:
        """Add generated ids; return the text that is now certain (possibly "")."""
        if self.finished:
            return ""
        self._window.extend(new_token_ids)
        return self._emit(self._decode_pending(flush=False), final=False)

    def finish(self) -> str:
        """The request ended (EOS, length, abort): return everything still held, partial bytes included."""
        if self.finished:
            return ""
        text = self._emit(self._decode_pending(flush=True), final=True)
        self.finished = True
        return text

    # ------------------------------------------------------------------------------------------------

    def _decode_pending(self, *, flush: bool) -> str:
        """Text of the pending ids, or "" while it ends in a partial character (unless flushing)."""
        if self._read == len(self._window):
            return ""
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix_text = decode(self._window[:self._read], skip_special_tokens=skip)
        full_text = decode(self._window, skip_special_tokens=skip)
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT) and not flush):
            return ""  # nothing visible yet (a skipped special token) or a character still incomplete
        del self._window[:self._read]  # the pending ids become the next prefix
        self._read = len(self._window)
        return full_text[len(prefix_text):]

    def _emit(self, new_text: str, *, final: bool) -> str:
        """Check ``held + new_text`` for stop strings; return what may be shown, hold the rest."""
        text = self._held + new_text
        if self.stop and (hit := self._find_stop(text)) is not None:
            index, stop = hit
            out = text[:index + len(stop)] if self.include_stop_str_in_output else text[:index]
            self.stop_reason, self.finished, self._held = stop, True, ""
            return self._returned(out)
        hold = 0 if final else self._hold_length(text)
        self._held = text[len(text) - hold:] if hold else ""
        return self._returned(text[:len(text) - hold])

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string in ``text`` that is complete first (the longest of those that end together).

        "Complete first" rather than "starts first": generation ends the moment any stop string
        has been produced, so the answer must not depend on how many characters a step brought.
        """
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = text.find(stop)
            if index >= 0 and (best is None or (index + len(stop), index) < (best[0] + len(best[1]), best[0])):
                best = (index, stop)
        return best

    def _hold_length(self, text: str) -> int:
        return held_prefix(text, self.stop, self._max_hold)

    def _returned(self, text: str) -> str:
        if text:
            self._chunks.append(text)
        return text
