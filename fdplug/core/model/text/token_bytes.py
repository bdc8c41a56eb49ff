"""A token's own bytes, for logprobs: what a client joins to rebuild text a token splits mid-character.

OpenAI's logprobs carry ``bytes`` for exactly this: a CJK character or an emoji is often two or three
byte-level tokens, and each decodes alone to U+FFFD, so the token's text cannot say which bytes it
holds. The bytes come from the vocabulary itself:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2: a ``ByteLevel`` decoder): each character of the
  token's string stands for one byte (GPT-2's printable byte alphabet), mapped back;
- SentencePiece with byte fallback (Llama 2, Mistral; GGUF ``llama`` vocabularies): a ``<0xE7>``
  piece is that byte, any other piece its text with ``▁`` as a space;
- any other tokenizer: the token decoded alone, as UTF-8.

Special and added tokens (``<|im_end|>``) are their text in every case.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map from its printable stand-in characters back to bytes (``bytes_to_unicode`` inverted)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _decoder_kinds(decoder: Any) -> set[str]:
    """The types of a tokenizer's decoder and of those a ``Sequence`` holds, from its JSON (the
    state every tokenizers version serializes; its repr lists the parts only in newer ones)."""
    if decoder is None:
        return set()
    try:
        spec = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return {type(decoder).__name__}
    kinds, todo = set(), [spec]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            kinds.add(node.get("type", ""))
            todo.extend(node.get("decoders") or ())
    return kinds


class TokenBytes:
    """``token_bytes(token_id)``: the token's bytes, by the rule of the tokenizer's decoder."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        kinds = _decoder_kinds(backend.decoder)
        self.byte_level = "ByteLevel" in kinds
        self.byte_fallback = "ByteFallback" in kinds and not self.byte_level
        self.added = {token.content for token in backend.get_added_tokens_decoder().values()}
        self._bytes = functools.lru_cache(maxsize=1 << 16)(self._compute)

    def __call__(self, token_id: int) -> bytes:
        return self._bytes(token_id)

    def _compute(self, token_id: int) -> bytes:
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if piece in self.added:
            return piece.encode()
        if self.byte_level:
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        elif self.byte_fallback:
            match = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(match.group(1), 16)]) if match else piece.replace("▁", " ").encode()
        return self.backend.decode([token_id], skip_special_tokens=False).encode()
