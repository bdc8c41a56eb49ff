"""Seeded random Qwen2 models in Hugging Face format, for tests, benchmarks and the conformance kit.

Why: they need real model directories of any shape on a machine that cannot download one. The
weights are random (the text is gibberish) but the files are exactly what a Hugging Face Qwen2
checkpoint looks like (config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a ChatML template), so the same loader, tokenizer and chat-template code
paths run as for a real model. The golden fixtures of the Hugging Face parity tests are made from
them (``tools/make_golden.py``). The model ``fdplug serve`` answers with is the trained one in
`fdplug.demo`.

Everything is generated from fixed seeds: two machines produce byte-identical files (for one
version of the ``tokenizers`` library, which serialises tokenizer.json). The files are written to a
temporary directory and renamed into place, so concurrent first runs never see a half-written model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from fdplug.demo.bpe import build_tokenizer
from fdplug.demo.chatml import SPECIAL_TOKENS, tokenizer_config
from fdplug.demo.corpus import BPE_CORPUS
from fdplug.demo.publish import (
    is_complete,
    publish,
    remove_stale_temps,
    write_json,
    write_marker,
)
from fdplug.errors import ConfigError
from fdplug.plugin_api.settings import cache_dir

DEMO_VERSION = 2
DEMO_SEED = 20240601
VOCAB_SIZE = 512  # 256 bytes + learned merges + added tokens, exactly

# ---------------------------------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------------------------------


def default_cache_root() -> Path:
    """``$FDPLUG_CACHE_DIR`` or ``~/.cache/fdplug``."""
    return cache_dir()


def ensure_random_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The demo model's directory under ``cache_dir`` (default: ``default_cache_root()``), written once.

    Safe to call from several processes at once: each writes its own temporary directory and renames
    it into place; a loser of the race finds the winner's complete copy and discards its own.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    target = root / f"demo-{DEMO_VERSION}"
    if is_complete(target, DEMO_VERSION):
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=root))
    except OSError as exc:
        raise ConfigError(f"cannot write the demo model under {root}: {exc.strerror or exc}.",
                          fix="set FDPLUG_CACHE_DIR to a writable directory.") from None
    try:
        write_random_model(tmp)
        publish(tmp, target, DEMO_VERSION)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    remove_stale_temps(root, target.name)
    return target


def write_random_model(out_dir: Path, **config_overrides: Any) -> None:
    """Write every file of the demo model into ``out_dir`` (which must exist), the marker last.

    ``config_overrides`` change the model's shape or init (tests and benchmarks use them for a
    smaller, sharper, or bigger random model with the same tokenizer); the demo itself uses none.
    """
    tokenizer = build_tokenizer(BPE_CORPUS, VOCAB_SIZE)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    config = build_config(vocab_size, bos_id=ids["<|endoftext|>"], eos_id=ids["<|im_end|>"])
    config |= {"image_token_id": tokenizer.token_to_id("<|image_pad|>"),
               "video_token_id": tokenizer.token_to_id("<|video_pad|>"),
               "vision_start_token_id": tokenizer.token_to_id("<|vision_start|>"),
               "vision_end_token_id": tokenizer.token_to_id("<|vision_end|>"),
               "vision_config": {"spatial_merge_size": 2},
               "fdplug_mm_mask_policy": "bidirectional_items"} | config_overrides
    if config["architectures"][0].startswith("Qwen3"):   # Qwen3 defaults head_dim to 128: say it
        config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    })
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(tokenizer))
    _save_safetensors(build_weights(config), out_dir / "model.safetensors")
    write_marker(out_dir, DEMO_VERSION)


# ---------------------------------------------------------------------------------------------------
# config and weights
# ---------------------------------------------------------------------------------------------------


def build_config(vocab_size: int, *, bos_id: int, eos_id: int) -> dict[str, Any]:
    """Qwen2 config: big enough that decode does real work on a CPU, small enough to be instant."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "hidden_act": "silu",
        "hidden_size": 256,
        "initializer_range": 0.02,
        "intermediate_size": 512,
        "max_position_embeddings": 4096,
        "max_window_layers": 4,
        "model_type": "qwen2",
        "num_attention_heads": 8,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes (Linear weights are [out, in]) of a Qwen2 model, or, when
    ``config`` names them, a Qwen3 (q/k norms, no q/k/v bias) or Qwen2-/Qwen3-MoE one (per-expert keys)."""
    from fdplug.core.model.checkpoint.moe_config import parse_moe

    arch = config["architectures"][0]
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    qwen3 = arch.startswith("Qwen3")
    moe = parse_moe(config, arch, layers)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q_dim, hidden), p + "self_attn.k_proj.weight": (kv_dim, hidden),
                   p + "self_attn.v_proj.weight": (kv_dim, hidden), p + "self_attn.o_proj.weight": (hidden, q_dim),
                   p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)}
        if qwen3:
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
        else:
            shapes |= {p + "self_attn.q_proj.bias": (q_dim,), p + "self_attn.k_proj.bias": (kv_dim,),
                       p + "self_attn.v_proj.bias": (kv_dim,)}
        if moe is not None and i in moe.layers:
            shapes |= _moe_shapes(p + "mlp.", hidden, moe)
        else:
            shapes |= _mlp_shapes(p + "mlp.", hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def _moe_shapes(prefix: str, hidden: int, moe: Any) -> dict[str, tuple[int, ...]]:
    shapes = {prefix + "gate.weight": (moe.num_experts, hidden)}
    for e in range(moe.num_experts):
        shapes |= _mlp_shapes(f"{prefix}experts.{e}.", hidden, moe.intermediate_size)
    if moe.shared_intermediate_size:
        shapes |= _mlp_shapes(prefix + "shared_expert.", hidden, moe.shared_intermediate_size)
        shapes[prefix + "shared_expert_gate.weight"] = (1, hidden)
    return shapes


def build_weights(config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Seeded weights, each tensor from its own stream so the values do not depend on order.

    Linear weights and embeddings are N(0, 0.02) as in HF's init. Biases and norm weights are
    perturbed away from HF's zeros and ones on purpose: a loader that drops a bias or a norm weight
    then gives different logits, so golden comparisons catch it.
    """
    std = config["initializer_range"]
    out = {}
    for name, shape in tensor_shapes(config).items():
        rng = np.random.default_rng([DEMO_SEED, zlib.crc32(name.encode())])
        noise = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith("norm.weight"):
            out[name] = 1.0 + np.float32(0.1) * noise
        else:
            out[name] = np.float32(std) * noise
    return out


def _save_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})  # "pt": transformers refuses files without it


