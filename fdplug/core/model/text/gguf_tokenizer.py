"""The tokenizer a GGUF file describes, rebuilt as a ``tokenizers.Tokenizer``.

A GGUF carries no ``tokenizer.json``: llama.cpp's converter writes the vocabulary, the merges (or
the SentencePiece scores), each token's type and the special ids as metadata. This module turns that
back into a Rust tokenizer that encodes and decodes as the model's original Hugging Face tokenizer
did, which is also what llama.cpp does for the same ``tokenizer.ggml.pre`` name:

* ``gpt2`` files are byte-level BPE, cut first by the regexes ``tokenizer.ggml.pre`` names
  (`gguf_pretokenizers`: refused, never guessed, when the name is unknown).
* ``llama`` files are SentencePiece BPE (Llama 1/2, Mistral v1, TinyLlama). As transformers does,
  the merges are recovered from the scores; spaces become ``▁`` with a prefix one before every
  stretch of text (the original ``tokenizer.json``'s ``Prepend`` normalizer, and llama.cpp's rule).

The caller reads the metadata (``{key: field.contents()}`` of ``gguf.GGUFReader(path).fields``), so
this module never opens a file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from fdplug.core.model.text.gguf_pretokenizers import PreTokenizer, pre_tokenizer
from fdplug.errors import ModelLoadError, UnsupportedModelError

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# Matched whole in text and dropped by decode(skip_special_tokens=True), as llama.cpp's CONTROL and
# UNKNOWN attributes are and as HF's special added tokens (<s>, <unk>, <|im_end|>) are.
_SPECIAL_TYPES = frozenset({CONTROL, UNKNOWN})

_SPECIAL_ID_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                    "pad_token": "padding_token_id", "unk_token": "unknown_token_id"}
_EXTRA_EOS_KEYS = ("eot_token_id", "eom_token_id")


@dataclass(slots=True)
class GgufTokenizer:
    """What fdplug's ``Tokenizer`` needs from a GGUF file's tokenizer metadata."""

    backend: HFTokenizer = field(repr=False)
    special_tokens: dict[str, str]  # bos_token/eos_token/pad_token/unk_token -> text, when the file names the id
    eos_token_ids: tuple[int, ...]  # eos first, then eot and eom when set and different
    special_token_ids: frozenset[int]  # exactly the ids decode(skip_special_tokens=True) drops
    # Whether encoding adds BOS: the file's flag, else llama.cpp's default for the vocabulary (true
    # for SentencePiece and Llama-3-style BPE). The backend's post-processor already follows it.
    add_bos_token: bool | None
    chat_template: str | None = field(default=None, repr=False)
    chat_templates: dict[str, str] = field(default_factory=dict, repr=False)  # tokenizer.chat_template.NAME


KNOWN_MODELS = ("gpt2", "llama")


def tokenizer_from_gguf(metadata: Mapping[str, Any]) -> GgufTokenizer:
    """The tokenizer of a GGUF file, from its metadata (``{key: field.contents()}``).

    Raises ``UnsupportedModelError`` for a tokenizer kind or pre-tokenizer this module cannot
    reproduce exactly, and ``ModelLoadError`` (naming the key) for metadata that contradicts itself.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in KNOWN_MODELS:
        what = "no tokenizer (no tokenizer.ggml.model)" if kind is None else f"a {kind!r} tokenizer"
        raise UnsupportedModelError(
            f"the GGUF file has {what}; fdplug reads only {' and '.join(map(repr, KNOWN_MODELS))} ones.",
            fix="serve the model's original Hugging Face directory (with tokenizer.json) instead.")
    tokens = _unempty(_str_list(metadata, "tokenizer.ggml.tokens", required=True))
    n = len(tokens)
    types = _int_list(metadata, "tokenizer.ggml.token_type", n) or [NORMAL] * n
    ids = {name: _token_id(metadata, key, n) for name, key in _SPECIAL_ID_KEYS.items()}
    extra_eos = [_token_id(metadata, key, n) for key in _EXTRA_EOS_KEYS]
    add_bos = _flag(metadata, "tokenizer.ggml.add_bos_token")
    add_eos = bool(_flag(metadata, "tokenizer.ggml.add_eos_token"))

    if kind == "gpt2":
        pre = pre_tokenizer(metadata)
        backend = _byte_level_bpe(tokens, types, _merges(metadata), pre)
        add_bos = pre.add_bos if add_bos is None else add_bos
    else:
        architecture = str(metadata.get("general.architecture", ""))
        if architecture.startswith("gemma"):  # whitespace tokens stored as spaces, merges by file order
            raise UnsupportedModelError(f"the SentencePiece tokenizer of a GGUF {architecture!r} model "
                                        f"is not supported.",
                                        fix="serve the model's original Hugging Face directory (with tokenizer.json).")
        scores = _float_list(metadata, "tokenizer.ggml.scores", n)
        if scores is None:
            raise ModelLoadError("the GGUF file's SentencePiece tokenizer has no tokenizer.ggml.scores.",
                                 fix="re-convert the model with llama.cpp's convert_hf_to_gguf.py.")
        if n > 2:  # llama.cpp's defaults for a SentencePiece vocabulary that names none
            ids = {"unk_token": 0, "bos_token": 1, "eos_token": 2} | {k: v for k, v in ids.items() if v is not None}
        prefix = _flag(metadata, "tokenizer.ggml.add_space_prefix")
        backend = _sentencepiece_bpe(tokens, scores, ids.get("unk_token"), prefix is not False)
        add_bos = True if add_bos is None else add_bos

    for added, name in ((add_bos, "bos_token"), (add_eos, "eos_token")):
        if added and ids.get(name) is None:
            raise _bad(f"tokenizer.ggml.{_SPECIAL_ID_KEYS[name]}", f"is missing, and the tokenizer must add {name}")
    special_ids = _add_special_tokens(backend, tokens, types)
    _set_post_processor(backend, tokens, ids["bos_token"] if add_bos else None, ids["eos_token"] if add_eos else None)
    eos = [ids["eos_token"], *extra_eos]
    templates = {key.removeprefix("tokenizer.chat_template."): value for key, value in metadata.items()
                 if key.startswith("tokenizer.chat_template.") and isinstance(value, str)}
    template = metadata.get("tokenizer.chat_template")
    return GgufTokenizer(
        backend=backend,
        special_tokens={name: tokens[i] for name, i in ids.items() if i is not None},
        eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
        special_token_ids=special_ids,
        add_bos_token=add_bos,
        chat_template=template if isinstance(template, str) else None,
        chat_templates=templates,
    )


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[tuple[str, str]],
                    pre: PreTokenizer) -> HFTokenizer:
    """GPT-2-style BPE over bytes spelled as printable characters, split by ``pre`` first.

    A normal token with a character outside the byte alphabet is respelled byte by byte, as
    transformers does. Control and user-defined tokens keep the text they are matched by (llama.cpp's
    converter writes them decoded: ``<｜end▁of▁sentence｜>``), so they stay reachable by their own id.
    """
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, token in enumerate(tokens):
        if types[i] == NORMAL and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = i  # a repeated text keeps its last id, as llama.cpp's token_to_id does
    backend = _build(lambda: HFTokenizer(BPE(vocab, merges, ignore_merges=pre.ignore_merges)), "tokenizer.ggml.merges")
    backend.normalizer = normalizers.NFC() if pre.nfc else None
    digits = [pre_tokenizers.Digits(individual_digits=True)] if pre.digits else []
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*digits, *(pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in pre.splits)]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], scores: list[float], unk_id: int | None, space_prefix: bool) -> HFTokenizer:
    """SentencePiece BPE with byte fallback, its merges recovered from the scores (transformers' way).

    Every stretch of text between added tokens gets a ``▁`` prefix (when the file asks for one) and
    its spaces become ``▁``: the original ``tokenizer.json``'s ``Prepend`` + ``Replace`` normalizer,
    and llama.cpp's rule. (transformers 5 prefixes only the start of the text: another id after a
    special token.) Decode turns ``▁`` back into spaces and drops the one prefix space.
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None else None
    merges = _merges_from_scores(tokens, scores, vocab)
    backend = _build(lambda: HFTokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)),
                     "tokenizer.ggml.tokens")
    prefix = [normalizers.Prepend("▁")] if space_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = None
    strip = [decoders.Strip(" ", 1, 0)] if space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best-scored result first: SentencePiece's merge order
    (transformers' ``generate_merges``, with the same tie-breaks)."""
    merges = []
    for token, score in dict(zip(tokens, scores)).items():
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(backend: HFTokenizer, tokens: list[str], types: list[int]) -> frozenset[int]:
    """Control and unknown-type tokens become special added tokens (matched whole in text, skipped
    on decode); user-defined ones (``<think>``) plain added tokens, matched whole but kept, as in
    llama.cpp and HF. Their texts are in the model's vocabulary, so each keeps its file id."""
    special = [i for i, t in enumerate(types) if t in _SPECIAL_TYPES]
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == USER_DEFINED])
    return frozenset(backend.token_to_id(tokens[i]) for i in special)  # a repeated text: its last id


def _set_post_processor(backend: HFTokenizer, tokens: list[str], bos: int | None, eos: int | None) -> None:
    """BOS/EOS added by ``encode(add_special_tokens=True)`` as the file asks (llama.cpp's add_bos/add_eos)."""
    if bos is None and eos is None:
        backend.post_processor = None
        return
    head = [tokens[bos]] if bos is not None else []
    tail = [tokens[eos]] if eos is not None else []
    backend.post_processor = processors.TemplateProcessing(
        single=[*head, "$A:0", *tail], pair=[*head, "$A:0", *tail, *head, "$B:1", *tail],
        special_tokens=[(tokens[i], i) for i in dict.fromkeys(i for i in (bos, eos) if i is not None)])


def _merges(metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``"a b"`` strings as pairs, cut at the first space after the first character (llama.cpp's rule)."""
    merges = []
    for i, merge in enumerate(_str_list(metadata, "tokenizer.ggml.merges", required=True)):
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ModelLoadError(f"tokenizer.ggml.merges[{i}] is {merge!r}, not two tokens separated by a space.",
                                 fix="re-convert the model with llama.cpp's convert_hf_to_gguf.py.")
        merges.append((merge[:cut], merge[cut + 1:]))
    return merges


def _unempty(tokens: list[str]) -> list[str]:
    """llama.cpp's name for an empty token text, which no tokenizer can store."""
    return [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]


def _build(make: Callable[[], HFTokenizer], key: str) -> HFTokenizer:
    try:
        return make()
    except Exception as exc:  # noqa: BLE001 -- tokenizers raises bare Exceptions (a merge of unknown tokens)
        raise ModelLoadError(f"the GGUF tokenizer cannot be built from {key}: {exc}.",
                             fix="re-convert the model with llama.cpp's convert_hf_to_gguf.py.") from None


def _bad(key: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"the GGUF metadata {key} {what}.",
                          fix="re-convert the model with llama.cpp's convert_hf_to_gguf.py, or re-download it.")


def _str_list(metadata: Mapping[str, Any], key: str, *, required: bool = False) -> list[str]:
    value = metadata.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise _bad(key, "is missing" if value is None else "is not a list of strings")
    if required and not value:
        raise _bad(key, "is empty")
    return list(value)


def _numbers(metadata: Mapping[str, Any], key: str, n: int, kind: type | tuple[type, ...],
             what: str) -> list[Any] | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(
            isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise _bad(key, f"is not a list of {what}")
    if len(value) != n:
        raise _bad(key, f"has {len(value)} entries for {n} tokens (tokenizer.ggml.tokens)")
    return list(value)


def _int_list(metadata: Mapping[str, Any], key: str, n: int) -> list[int] | None:
    return _numbers(metadata, key, n, int, "integers")


def _float_list(metadata: Mapping[str, Any], key: str, n: int) -> list[float] | None:
    values = _numbers(metadata, key, n, (int, float), "numbers")
    return None if values is None else [float(v) for v in values]


def _token_id(metadata: Mapping[str, Any], name: str, n: int) -> int | None:
    key = f"tokenizer.ggml.{name}"
    value = metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n:
        raise _bad(key, f"is {value!r}, not a token id below {n}")
    return value


def _flag(metadata: Mapping[str, Any], key: str) -> bool | None:
    value = metadata.get(key)
    if value is not None and not isinstance(value, bool):
        raise _bad(key, f"is {value!r}, not true or false")
    return value


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, the alphabet byte-level vocabularies are written in:
    printable Latin-1 bytes stand for themselves, the others for the characters from U+0100 on."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}
