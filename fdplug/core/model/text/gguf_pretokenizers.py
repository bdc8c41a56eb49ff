"""How a GGUF file's byte-level BPE vocabulary cuts text before the merges, by ``tokenizer.ggml.pre``.

The merges were learned on text cut by a model-specific regex that the file only names; the
regexes here are the original ``tokenizer.json`` ones, as transformers and llama.cpp
(``src/llama-vocab.cpp``) spell them. A name not in the table is refused rather than guessed: the
wrong split gives plausible, wrong ids that the model then misreads without any error.
`gguf_tokenizer` builds the tokenizer around the one chosen.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fdplug.errors import UnsupportedModelError


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """How one family of byte-level vocabularies cuts text before BPE, after llama.cpp's table."""

    splits: tuple[str, ...]  # regexes applied in turn; each match and each gap between becomes a piece
    digits: bool = False  # every digit a piece of its own first: HF's Digits(individual_digits=True)
    nfc: bool = False  # the original tokenizer.json NFC-normalizes (Qwen2, Cohere); llama.cpp does not
    ignore_merges: bool = False  # a whole piece in the vocabulary is one token (Llama 3, Tekken)
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTION
          + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTION
          + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek LLM's letters (a subset of Unicode's cased letters), as code points: several of them
# (U+1FBE, U+2126 OHM, U+212A KELVIN...) are folded by NFC, which an editor or a copy may apply.
_DEEPSEEK_CASED = (
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF),
    (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377), (0x37B, 0x37D), (0x37F, 0x37F), (0x386, 0x386),
    (0x388, 0x38A), (0x38C, 0x38C), (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556),
    (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B),
    (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D), (0x1F20, 0x1F45), (0x1F48, 0x1F4D),
    (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B), (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4),
    (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE), (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB),
    (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102), (0x2107, 0x2107), (0x210A, 0x2113),
    (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126), (0x2128, 0x2128), (0x212A, 0x212D),
    (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149), (0x214E, 0x214E), (0x2183, 0x2184),
    (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE), (0x2CF2, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B),
    (0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17),
    (0xFF21, 0xFF3A), (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB),
    (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943),
)
_DEEPSEEK_LETTERS = "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in _DEEPSEEK_CASED)
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # as llama.cpp and the original spell it
_DEEPSEEK_LLM = ("[\r\n]", r"\s?[" + _DEEPSEEK_LETTERS + "]+",
                 "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", _CJK_HANGUL, r"\p{N}+")
_DEEPSEEK_V3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                 r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"))
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")


def _family(names: str, pre: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), pre)


_PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    # llama.cpp's fallback for files written before the pre key existed (its DEFAULT type)
    **_family("default", PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))),
    **_family("gpt-2 gpt2 phi-2", PreTokenizer((_GPT2,))),
    # llama.cpp cuts off each "\p{N}" first; the original tokenizer.json has HF's Digits step (Rust's
    # char::is_numeric), used here: both take ½, ² and Ⅻ for digits, which transformers 5 misses
    **_family("smollm starcoder refact", PreTokenizer((_GPT2,), digits=True)),
    **_family("command-r", PreTokenizer((_GPT2,), digits=True, nfc=True)),
    **_family("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
              PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    **_family("dbrx smaug-bpe", PreTokenizer((_LLAMA3,))),
    **_family("qwen2 deepseek-r1-qwen megrez", PreTokenizer((_QWEN2,), nfc=True)),
    **_family("qwen35", PreTokenizer((_QWEN35,), nfc=True)),
    **_family("tekken", PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
    **_family("gpt-4o llama4 minimax-m2", PreTokenizer((_GPT4O,))),
    **_family("deepseek-llm", PreTokenizer(_DEEPSEEK_LLM)),
    **_family("deepseek-v3", PreTokenizer(_DEEPSEEK_V3)),
    **_family("deepseek-coder", PreTokenizer(_DEEPSEEK_CODER)),
}
KNOWN_PRE_TOKENIZERS = tuple(sorted(_PRE_TOKENIZERS))


def pre_tokenizer(metadata: Mapping[str, Any]) -> PreTokenizer:
    name = metadata.get("tokenizer.ggml.pre", "default")  # llama.cpp's reading of a file without one
    if name not in _PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"the GGUF file's byte-level tokenizer uses pre-tokenizer {name!r} (tokenizer.ggml.pre), which fdplug "
            f"cannot reproduce; known: {', '.join(KNOWN_PRE_TOKENIZERS)}.",
            fix="serve the model's original Hugging Face directory (with tokenizer.json) instead.")
    return _PRE_TOKENIZERS[name]
