"""A Qwen2-style byte-level BPE tokenizer, learned in plain Python from a given text.

Done here rather than with ``tokenizers``' trainer so the merges depend on nothing but this code:
two machines learn the same tokenizer from the same text.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from fdplug.demo.chatml import EXTRA_TOKENS, SPECIAL_TOKENS, VISION_TOKENS

# Qwen2's pre-tokenizer regex (tokenizer.json of Qwen2/Qwen2.5).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE tokens are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer(text: str, vocab_size: int) -> Any:
    """A Qwen2-style byte-level BPE tokenizer of exactly ``vocab_size`` tokens, merges learned from ``text``."""
    pre = pre_tokenizer()
    return tokenizer_from_pieces([piece for piece, _ in pre.pre_tokenize_str(text)], vocab_size, pre)


def pre_tokenizer() -> Any:
    """Qwen2's split regex, then byte-level: the pieces merges are learned from and applied to."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


def tokenizer_from_pieces(pieces: list[str], vocab_size: int, pre: Any) -> Any:
    """The tokenizer whose merges are learned from pre-tokenized ``pieces``, with the demo's added tokens."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        processors,
    )

    byte_tokens = [ch for _, ch in sorted(bytes_to_unicode().items())]
    n_learned = vocab_size - 256 - len(SPECIAL_TOKENS) - len(VISION_TOKENS) - len(EXTRA_TOKENS)
    vocab, merges = learn_bpe(byte_tokens, pieces, n_learned)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + VISION_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXTRA_TOKENS])
    return tok


def learn_bpe(alphabet: list[str], pieces: list[str], n_tokens: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Plain BPE training: the most frequent pair wins, ties go to the smallest pair."""
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    words = Counter(tuple(piece) for piece in pieces)
    merges: list[tuple[str, str]] = []
    target = len(vocab) + n_tokens
    while len(vocab) < target:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            raise RuntimeError("demo corpus too small for the requested vocabulary")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        words = Counter({_merge_word(w, best): c for w, c in words.items()})
    return vocab, merges


def _merge_word(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)
