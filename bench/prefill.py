"""Time to first token of a fresh prompt: the cpu plugin's prefill attention against the reference's.

    python bench/prefill.py            # bench/throughput.py's 54M Qwen2, 1,024-token prompts
    python bench/prefill.py --quick    # fewer pairs
    python bench/prefill.py --heads 9 --kv-heads 3    # SmolLM2-135M's attention shape (heads of 64)
    FDPLUG_CPU_ISA=avx2 python bench/prefill.py       # the AVX2 kernel (prefill_attention_avx2.c)

Two engines on the same float32 model, alternated in ABBA order, medians: ``cpu_native`` attention
(prefill pieces through ``fdplug_prefill_attention``: blocked, online softmax, AVX-512 or AVX2) and the
``reference`` backend (paddle matmuls, a mask and paddle's softmax). Everything else is the same
(the cpu plugin's linear, SwiGLU). Also prints the prefill's model FLOP/s.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

from linear import abba, fresh_prompt, generate_seconds
from throughput import MODEL, make_model


def prefill_flops(tokens: int) -> float:
    """Multiply-adds x 2 of the linears (lm_head for one row) and of causal attention."""
    h, inter, layers = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["num_hidden_layers"]
    kv = h * MODEL["num_key_value_heads"] // MODEL["num_attention_heads"]
    linears = layers * (h * (h + 2 * kv) + h * h + 3 * h * inter) * tokens
    attention = layers * h * tokens * (tokens + 1)      # q.k and p.v over tokens * (tokens + 1) / 2 keys
    return 2.0 * (linears + attention + h * MODEL["vocab_size"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 pairs")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=MODEL["num_attention_heads"],
                        help="query heads (hidden = heads x 64)")
    parser.add_argument("--kv-heads", type=int, default=MODEL["num_key_value_heads"])
    args = parser.parse_args()
    MODEL.update(num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, hidden_size=64 * args.heads)
    logging.disable(logging.INFO)
    from fdplug.core.frontend.llm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp))
        engine_args = {"max_model_len": 4096, "max_num_batched_tokens": max(2048, args.tokens), "num_kv_blocks": 512}
        llms = {"cpu_native": LLM(str(model), attention_backend="cpu_native", **engine_args),
                "reference": LLM(str(model), attention_backend="reference", **engine_args)}
        ttft = abba(llms, 3 if args.quick else 8,
                    lambda llm, rng: generate_seconds(llm, fresh_prompt(rng, args.tokens), 1))
        flops = prefill_flops(args.tokens)
        for name, seconds in ttft.items():
            print(f"TTFT, fresh {args.tokens}-token prompt, {name:10s} attention: {seconds * 1e3:6.0f} ms "
                  f"({flops / seconds / 1e9:.0f} GFLOP/s of model math)")
        print(f"reference/cpu_native {ttft['reference'] / ttft['cpu_native']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
