"""Build tiny random Hugging Face models and their transformers logits: fdplug's parity fixtures.

Needs torch and transformers (dev only, never a runtime or CI dependency)::

    pip install torch transformers
    python tools/make_golden.py            # writes tests/fixtures/golden/<name>/

Each model dir holds what a real checkpoint holds (config.json, safetensors weights, sometimes a
generation_config.json or a sharded index) plus ``golden.json`` (the token sequences) and
``logits_<i>.npy`` (transformers' float32 logits for sequence ``i``). The logits are computed by
reloading the written directory with ``from_pretrained``, so they are what transformers makes of
exactly the files shipped. Deterministic: same seeds, same files (given the same torch and
transformers versions, which ``golden.json`` records).

The variants cover what differs between architectures: Llama (plain; llama3 RoPE + biases + tied +
sharded + 4.x config keys), Qwen2 (q/k/v bias, linear RoPE, bf16 weights, generation_config eos),
Qwen3 (q/k norm, YaRN, tied, 5.x rope_parameters), ERNIE-4.5 (interleaved RoPE, use_bias,
head_dim != hidden/heads, tied by default).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "golden"
VOCAB = 256
SEQUENCES = [[int(t) for t in np.random.default_rng(1234).integers(0, VOCAB, n)] for n in (12, 7)]

_BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 128,
         "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2}

# name -> (config.json as a checkpoint in the wild would have it, storage dtype, extras)
SPECS: dict[str, tuple[dict, str, dict]] = {
    "llama": ({**_BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 10000.0,
               "tie_word_embeddings": False, "torch_dtype": "float32"}, "float32", {}),
    "llama3_rope": ({**_BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 10000.0,
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                     "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True,
                     "torch_dtype": "float32"}, "float32", {"shard": "150KB"}),
    "qwen2_linear_bf16": ({**_BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                           "rope_theta": 1000000.0, "rope_scaling": {"type": "linear", "factor": 2.0},
                           "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 2,
                           "tie_word_embeddings": False, "torch_dtype": "bfloat16"}, "bfloat16",
                          {"generation_config": {"bos_token_id": 1, "eos_token_id": [3, 2]}}),
    "qwen3_yarn": ({**_BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16,
                    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 32},
                    "tie_word_embeddings": True, "dtype": "float32"}, "float32", {}),
    "ernie4_5": ({**_BASE, "architectures": ["Ernie4_5ForCausalLM"], "model_type": "ernie4_5", "head_dim": 32,
                  "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "use_bias": True, "pad_token_id": 0,
                  "torch_dtype": "float32"}, "float32", {}),  # tie_word_embeddings left to its default (True)
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) activations (HF's 0.02-std init makes logits near-uniform, a weak test)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif p.dim() == 2 and "embed_tokens" not in name:
                p.copy_(noise / math.sqrt(p.shape[1]))
            else:
                p.copy_(noise)


def build(name: str, config_json: dict, dtype: str, extras: dict, seed: int) -> None:
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    if "generation_config" in extras:
        (out / "generation_config.json").write_text(json.dumps(extras["generation_config"], indent=2) + "\n")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.float32)
    randomize(model, seed)
    model = model.to(getattr(torch, dtype))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, max_shard_size=extras.get("shard", "50GB"))
        for path in sorted(Path(tmp).iterdir()):
            if path.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy(path, out / path.name)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    for (n, a), b in zip(model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a.float(), b), f"{name}: {n} changed on save/reload"
    with torch.no_grad():
        for i, seq in enumerate(SEQUENCES):
            logits = reloaded(torch.tensor([seq])).logits[0].float().numpy()
            np.save(out / f"logits_{i}.npy", logits.astype(np.float32))
    meta = {"sequences": SEQUENCES, "storage_dtype": dtype, "torch": torch.__version__,
            "transformers": transformers.__version__}
    (out / "golden.json").write_text(json.dumps(meta, indent=1) + "\n")
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{name:20s} {size / 1024:7.1f} KiB  {sorted(p.name for p in out.iterdir())}")


def main() -> None:
    torch.use_deterministic_algorithms(True)
    for seed, (name, (config_json, dtype, extras)) in enumerate(SPECS.items()):
        build(name, config_json, dtype, extras, seed=1000 + seed)
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"total {total / 1024:.1f} KiB in {OUT}")


if __name__ == "__main__":
    main()
