"""The seeded random models tests use: Hugging Face Qwen2 files, deterministic, written atomically."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from safetensors import safe_open

from fdplug.core.model.text.tokenizer import Tokenizer
from fdplug.demo import random_model as demo
from fdplug.demo.publish import MARKER
from fdplug.demo.random_model import DEMO_VERSION, ensure_random_model
from fdplug.errors import ConfigError

FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         MARKER}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_random_model(tmp_path_factory.mktemp("demo"))


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_files_and_config(model_dir):
    assert model_dir.name == f"demo-{DEMO_VERSION}"
    assert {p.name for p in model_dir.iterdir()} == FILES
    cfg = _config(model_dir)
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "float32"
    tok = Tokenizer.from_dir(model_dir)
    assert cfg["vocab_size"] == tok.vocab_size
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert tok.token_to_id("<|im_end|>") in gen["eos_token_id"]
    assert (model_dir / "model.safetensors").stat().st_size < 16 * 2**20


def test_tensor_names_and_shapes_follow_config(model_dir):
    """Shapes derived here from config.json alone, the way a loader would, not from demo.py."""
    cfg = _config(model_dir)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    expected = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        expected.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    with safe_open(str(model_dir / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        got = {name: f.get_slice(name).get_shape() for name in f.keys()}
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
        embed = f.get_tensor("model.embed_tokens.weight")
        norm = f.get_tensor("model.norm.weight")
    assert {k: tuple(s) for k, s in got.items()} == expected  # no lm_head: tied to the embedding
    assert dtypes == {"F32"}
    assert 0.015 < embed.std() < 0.025 and abs(norm.mean() - 1.0) < 0.05


def test_deterministic_bytes(tmp_path, model_dir):
    """A fresh interpreter (other hash seeds, other Rust HashMap keys) writes the same bytes."""
    code = ("import sys; from fdplug.demo.random_model import ensure_random_model; "
            "print(ensure_random_model(sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": "random"})
    other = Path(out.stdout.strip())
    assert other != model_dir
    for name in FILES:
        assert (other / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_reused_then_repaired(tmp_path):
    path = ensure_random_model(tmp_path)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_random_model(tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # not rewritten
    good = (path / "config.json").read_bytes()
    (path / "config.json").write_text("{}")  # damaged: the marker's hash no longer matches
    assert ensure_random_model(tmp_path) == path
    assert (path / "config.json").read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary or broken dirs left


def test_unwritable_cache_dir_is_typed(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="FDPLUG_CACHE_DIR"):
        ensure_random_model(tmp_path / "file" / "sub")


def test_default_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FDPLUG_CACHE_DIR", str(tmp_path / "cache"))
    assert demo.default_cache_root() == tmp_path / "cache"
    monkeypatch.delenv("FDPLUG_CACHE_DIR")
    assert demo.default_cache_root() == Path("~/.cache/fdplug").expanduser()


def _ensure(root: str) -> str:
    return str(ensure_random_model(root))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_concurrent_first_runs(tmp_path, model_dir):
    with ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("fork")) as pool:
        paths = list(pool.map(_ensure, [str(tmp_path)] * 4))
    assert len(set(paths)) == 1
    path = Path(paths[0])
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    for name in FILES:
        assert (path / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_loads_in_transformers(model_dir):
    """Hugging Face reads the files as a Qwen2 checkpoint: every tensor used, none missing."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    text = "Hello, world! 你好 😀 <|im_start|>user\nhi<|im_end|>"
    assert hf_tok(text)["input_ids"] == tok.encode(text)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                {"role": "user", "content": "Again"}]
    assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(messages)
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode(text)])).logits
    assert logits.shape[-1] == tok.vocab_size and torch.isfinite(logits).all()
