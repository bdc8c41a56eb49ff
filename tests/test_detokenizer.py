"""Incremental detokenizer: streamed deltas, split UTF-8 characters, stop strings, special tokens."""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fdplug.core.model.text.detokenizer import IncrementalDetokenizer
from fdplug.core.model.text.tokenizer import Tokenizer
from fdplug.demo.random_model import ensure_random_model


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(ensure_random_model(tmp_path_factory.mktemp("demo")))


def stream(tok, ids, chunks=None, **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ``ids`` in chunks of the given sizes (default 1), then finish; return every delta."""
    detok = IncrementalDetokenizer.for_request(tok, **kwargs)
    deltas, i = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(detok.step(ids[i:i + size]))
        i += size
    deltas.append(detok.step(ids[i:]))
    deltas.append(detok.finish())
    return deltas, detok


def expected_stop(text: str, stops: list[str]) -> str:
    """Reference: grow the text one character at a time and cut at the first stop that completes."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[:end - max(map(len, done))]
    return text


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_deltas_concatenate_to_full_decode(tok, data, skip):
    """Any ids (invalid UTF-8 and special tokens included), any chunking: same text as one decode."""
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    deltas, detok = stream(tok, ids, chunks, skip_special_tokens=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip) == detok.output_text


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=30))
def test_valid_utf8_never_yields_replacement_char(tok, text):
    text = unicodedata.normalize("NFC", text).replace("\ufffd", "")
    deltas, _ = stream(tok, tok.encode(text), skip_special_tokens=False)  # text may spell "<|im_end|>"
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == text


def test_split_character_is_held_until_complete(tok):
    ids = tok.encode("😀")
    assert len(ids) == 4  # one byte per token in the demo vocabulary
    detok = IncrementalDetokenizer.for_request(tok)
    assert [detok.step([i]) for i in ids] == ["", "", "", "😀"]


def test_incomplete_character_flushed_at_finish(tok):
    ids = tok.encode("ab😀")[:-1]  # the model stopped mid-character
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == "ab\ufffd" and deltas[-1] == "\ufffd"


@pytest.mark.parametrize("text, stops, want", [
    ("Hello world, bye", ["world"], "Hello "),
    ("Hello world, bye", [", b", "wor"], "Hello "),  # the first to complete wins, whatever its list order
    ("xabcd", ["abcd", "bc"], "xa"),  # "bc" is complete before "abcd", which starts earlier
    ("Hello world, bye", ["Hello"], ""),  # at the very start
    ("Hello world, bye", ["bye"], "Hello world, "),  # at the very end
    ("Hello world, bye", ["xyz", "lo w"], "Hel"),
    ("Hello world, bye", ["wordy", "world!"], "Hello world, bye"),  # prefixes that never complete
    ("a\n\nb", ["\n\n"], "a"),
    ("你好，世界！", ["世界"], "你好，"),
    ("emoji 😀 here", ["😀"], "emoji "),
])
def test_stop_strings(tok, text, stops, want):
    for chunks in (None, [3] * 10):
        deltas, detok = stream(tok, tok.encode(text), chunks, stop=stops)
        assert "".join(deltas) == want
        stopped = want != text
        assert detok.finished and (detok.stop_reason is not None) == stopped


def test_stop_string_spanning_deltas_is_never_emitted_early(tok):
    detok = IncrementalDetokenizer.for_request(tok, stop=["<END>"])
    shown = [detok.step(tok.encode(piece)) for piece in ["Hello ", "<E", "N", "D", "> more"]]
    assert shown == ["Hello ", "", "", "", ""]
    assert detok.stop_reason == "<END>" and detok.finished
    assert detok.step(tok.encode("later")) == "" and detok.finish() == ""


def test_held_prefix_released_when_it_is_not_a_stop(tok):
    detok = IncrementalDetokenizer.for_request(tok, stop=["<END>"])
    assert detok.step(tok.encode("a <EN")) == "a "
    assert detok.step(tok.encode("X")) == "<ENX"
    assert detok.step(tok.encode("b <")) == "b "
    assert detok.finish() == "<"  # finishing releases held text
    assert detok.stop_reason is None and detok.output_text == "a <ENXb <"


def test_include_stop_str_and_single_string_stop(tok):
    deltas, detok = stream(tok, tok.encode("one two three"), stop="two", include_stop_str_in_output=True)
    assert "".join(deltas) == "one two" and detok.stop_reason == "two"


@settings(max_examples=150, deadline=None)
@given(data=st.data(), text=st.text(alphabet="ab c\n😀", max_size=30),
       stops=st.lists(st.text(alphabet="ab c😀", min_size=1, max_size=4), max_size=3))
def test_stop_strings_match_reference(tok, data, text, stops):
    """Whatever the stops and however many tokens each step brings, the cut is the reference's."""
    ids = tok.encode(text)
    chunks = data.draw(st.lists(st.integers(1, 5), max_size=len(ids)))
    deltas, detok = stream(tok, ids, chunks, stop=stops)
    want = expected_stop(text, stops)
    assert "".join(deltas) == want == detok.output_text
    assert not any(expected_stop(d, stops) != d for d in deltas)  # no delta contains a stop string


def test_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nhi<|im_end|>")
    assert "".join(stream(tok, ids)[0]) == "assistant\nhi"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == "<|im_start|>assistant\nhi<|im_end|>"


def test_prompt_context_keeps_leading_space():
    """SentencePiece decoders drop the first token's leading space; prompt context avoids that."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    backend = HFTokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer(backend, {}, {}, (), frozenset())
    assert IncrementalDetokenizer.for_request(tok).step([1]) == "world"
    assert IncrementalDetokenizer.for_request(tok, [0]).step([1]) == " world"
    assert IncrementalDetokenizer.for_request(tok, np.array([1, 1, 0])).step([1]) == " world"
    assert IncrementalDetokenizer.for_request(tok, [1] * 9 + [0]).step([1, 0]) == " world Hello"


def test_decode_window_stays_short(tok):
    """O(new tokens) per step: decode never sees more than a few ids, however long the output."""
    seen = []

    class Spy:
        def decode(self, ids, *, skip_special_tokens=True):
            seen.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode("The quick brown fox 😀 jumps. 你好！ " * 60)
    detok = IncrementalDetokenizer.for_request(Spy(), list(range(100)), stop=["never here"])
    text = "".join(detok.step([i]) for i in ids) + detok.finish()
    assert text == tok.decode(ids) and len(ids) > 500
    assert max(seen) <= 8
