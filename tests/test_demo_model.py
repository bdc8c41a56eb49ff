"""The demo model `fdplug serve` and `fdplug.LLM()` run without a model: trained, small, speaking.

It ships in the package (``fdplug/demo/model``, made by ``tools/train_demo_model.py``), answers in
recognisable words, and its greedy output depends on the prompt, so a newcomer sees the server work
and tests over HTTP can tell that their inputs reach the model.
"""

from __future__ import annotations

import json
import re

import pytest

from fdplug.core.frontend.llm import LLM
from fdplug.core.model.text.tokenizer import Tokenizer
from fdplug.demo import demo_model_dir
from fdplug.demo.chatml import EXTRA_TOKENS, SPECIAL_TOKENS, VISION_TOKENS
from fdplug.plugin_api.sampling_params import SamplingParams

# Words the Python documentation the demo was trained on uses all the time.
COMMON = {"the", "a", "is", "of", "to", "and", "in", "statement", "python", "object", "value", "if", "for",
          "i", "am", "demo", "model", "as", "are", "be", "an", "with", "function", "list", "class"}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512, num_kv_blocks=128)


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", text)


def test_ships_in_the_package_as_a_small_qwen2_directory():
    model_dir = demo_model_dir()
    files = {p.name: p.stat().st_size for p in model_dir.iterdir()}
    assert set(files) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                          "tokenizer_config.json"}
    assert sum(files.values()) <= 1_000_000
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"]
    tokenizer = Tokenizer.from_dir(model_dir)
    for token in (*SPECIAL_TOKENS, *VISION_TOKENS, *EXTRA_TOKENS):   # chat, multimodal and tool calls work
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    assert config["image_token_id"] == tokenizer.token_to_id("<|image_pad|>")


def test_answers_hello_with_words(llm):
    out = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=24),
                   use_tqdm=False)[0].outputs[0]
    said = words(out.text)
    assert "\ufffd" not in out.text and len(said) >= 5, out.text
    assert sum(w.lower() in COMMON for w in said) >= 3, out.text


def test_greedy_output_depends_on_the_prompt(llm):
    prompts = ['The "for" statement', "A class definition", "import", "What is a list?"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert len(set(texts)) == len(prompts), texts
    assert all("\ufffd" not in t for t in texts)
    english = [w for t in texts for w in words(t)]
    assert sum(w.lower() in COMMON for w in english) >= len(prompts), texts
