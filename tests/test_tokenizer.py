"""Tokenizer: encode/decode, special and EOS ids, and the sandboxed chat template."""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fdplug.core.model.text.tokenizer import Tokenizer
from fdplug.demo.random_model import ensure_random_model
from fdplug.errors import InvalidRequestError, ModelLoadError


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return ensure_random_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def tok(demo_dir) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


def _copy(demo_dir: Path, dest: Path, *, config: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A model dir with the demo's tokenizer files, tokenizer_config changed by ``config``."""
    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if name not in drop:
            shutil.copy(demo_dir / name, dest / name)
    if config is not None:
        cfg = json.loads((dest / "tokenizer_config.json").read_text())
        cfg.update(config)
        cfg = {k: v for k, v in cfg.items() if v is not ...}
        (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


# ---------------------------------------------------------------------------------------------------
# encode / decode
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "", "Hello, world!", "  leading and trailing  \n\n\ttabs\r\n", "naïve café — “quotes” ½ ∑",
    "你好，世界！语言模型", "日本語のテキスト", "한국어 텍스트", "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷",
    "mixed 中文 and English 123 4567 😀", "def f(x):\n    return x ** 2\n",
])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40))
def test_round_trip_any_text(tok, text):
    text = unicodedata.normalize("NFC", text)  # the tokenizer normalises to NFC, as Qwen2's does
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_special_tokens(tok):
    im_start, im_end, eot = (tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    vision = {tok.token_to_id(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")}
    assert tok.special_token_ids == {im_start, im_end, eot} | vision
    assert tok.token_to_id("<tool_call>") not in tok.special_token_ids  # added, but not special
    assert tok.eos_token_ids == (im_end, eot) and tok.eos_token_id == im_end
    assert tok.pad_token_id == eot and tok.bos_token_id is None


def test_eos_ids_merged_from_generation_config(demo_dir, tmp_path):
    path = _copy(demo_dir, tmp_path / "m", config={"eos_token": {"content": "<|endoftext|>", "special": True}})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert Tokenizer.from_dir(path).eos_token_ids == (Tokenizer.from_dir(path).token_to_id("<|endoftext|>"), 5)


def test_add_bos_token(demo_dir, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    plain = _copy(demo_dir, tmp_path / "plain", config={"bos_token": "<|endoftext|>", "add_bos_token": True})
    tok = Tokenizer.from_dir(plain)
    bos = tok.bos_token_id
    assert tok.encode("hi")[0] == bos and tok.encode("hi", add_special_tokens=False)[0] != bos
    # tokenizer.json adds a BOS that tokenizer_config forbids: transformers drops it, so do we.
    backend = HFTokenizer.from_file(str(plain / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[
        ("<|endoftext|>", bos)])
    forbid = _copy(demo_dir, tmp_path / "forbid", config={"bos_token": "<|endoftext|>", "add_bos_token": False})
    backend.save(str(forbid / "tokenizer.json"))
    assert Tokenizer.from_dir(forbid).encode("hi")[0] != bos
    keep = _copy(demo_dir, tmp_path / "keep", config={"bos_token": "<|endoftext|>", "add_bos_token": ...})
    backend.save(str(keep / "tokenizer.json"))
    assert Tokenizer.from_dir(keep).encode("hi")[0] == bos


def test_missing_tokenizer_is_typed(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------------------------------------------
# chat template
# ---------------------------------------------------------------------------------------------------


def test_chatml_exact(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "你好 😀"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n你好 😀<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_tools_and_tool_calls(tok):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    prompt = tok.apply_chat_template(messages, tools=tools)
    assert '<tools>\n{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}\n</tools>' \
        in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<|im_end|>\n') in prompt
    assert prompt.endswith("<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'  # caller's dict untouched


def test_content_parts(tok):
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}},
             {"type": "text", "text": "b"}]
    with pytest.raises(InvalidRequestError, match="'image_url' part; this model takes text only"):
        tok.apply_chat_template([{"role": "user", "content": parts}])
    prompt = tok.apply_chat_template([{"role": "user", "content": parts}],
                                     content_part_handler=lambda part, index: f"<img{index}>")
    assert "<|im_start|>user\na\n<img0>\nb<|im_end|>" in prompt


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "wizard", "content": "x"}], "role 'wizard'"),
    ([{"content": "x"}], "role None"),
    (["hello"], "not an object"),
    ([{"role": "user", "content": None}], "no content"),
    ([{"role": "user", "content": 3}], "content is a int"),
    ([{"role": "user", "content": [{"text": "x"}]}], "part without a type"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
     "not valid JSON"),
])
def test_invalid_messages(tok, messages, match):
    with pytest.raises(InvalidRequestError, match=match) as err:
        tok.apply_chat_template(messages)
    assert err.value.fix and err.value.http_status == 400


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{% set x = messages.append(1) %}",
    "{{ messages[0].update({'role': 'x'}) }}",
])
def test_sandbox_blocks_escapes(tok, template):
    with pytest.raises(InvalidRequestError, match="sandbox forbids") as err:
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template)
    assert "unsafe" in str(err.value)


def test_template_helpers(tok):
    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{% generation %}{{ m.content | tojson }}{% endgeneration %}{% endfor %}"
                "|{{ {'b': '<&>', 'a': 1} | tojson }}|{{ strftime_now('%Y') | length }}|{{ eos_token }}|{{ flag }}")
    out = tok.apply_chat_template([{"role": "user", "content": "ü<"}, {"role": "user", "content": "z"}],
                                  chat_template=template, flag="on")
    assert out == '"ü<"|{"b": "<&>", "a": 1}|4|<|im_end|>|on'


def test_template_raise_exception(tok):
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('System message first!') }}{% endif %}"
    with pytest.raises(InvalidRequestError, match="rejected the conversation: System message first!"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template)


def test_template_errors(tok):
    with pytest.raises(InvalidRequestError, match="not valid Jinja"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% for %}")
    with pytest.raises(InvalidRequestError, match="rendering the chat template failed: TypeError"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{{ 1 + messages }}")
    with pytest.raises(InvalidRequestError, match="no chat template named 'nope'"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="nope")


def test_missing_template_is_typed(demo_dir, tmp_path):
    tok = Tokenizer.from_dir(_copy(demo_dir, tmp_path / "m", config={"chat_template": ...}))
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequestError, match="no chat template") as err:
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert "completions" in err.value.fix


def test_template_sources(demo_dir, tmp_path):
    named = [{"name": "default", "template": "D{{ messages | length }}"}, {"name": "tool_use", "template": "T"}]
    path = _copy(demo_dir, tmp_path / "m", config={"chat_template": named})
    msgs = [{"role": "user", "content": "x"}]
    assert Tokenizer.from_dir(path).apply_chat_template(msgs) == "D1"
    assert Tokenizer.from_dir(path).apply_chat_template(msgs, tools=[{"type": "function"}]) == "T"
    assert Tokenizer.from_dir(path).apply_chat_template(msgs, chat_template="tool_use") == "T"
    (path / "chat_template.jinja").write_text("J{{ add_generation_prompt }}")  # wins, as in transformers
    assert Tokenizer.from_dir(path).apply_chat_template(msgs) == "JTrue"
    only_named = _copy(demo_dir, tmp_path / "n", config={"chat_template": named[1:]})
    with pytest.raises(InvalidRequestError, match="no default"):
        Tokenizer.from_dir(only_named).apply_chat_template(msgs)
