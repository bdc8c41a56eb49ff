"""The engine as selected against the all-portable engine, at this CPU's (or FDPLUG_CPU_ISA's) level.

    python bench/levels.py                          # the CPU's own level
    FDPLUG_CPU_ISA=avx2 python bench/levels.py      # capped to x86-64-v3: the AVX2 kernels
    python bench/levels.py --quick                  # 3 pairs, fewer requests

Issue 33's bar: with the default selection (the linear kernel timed against paddle's matmul per
layer shape, `fdplug.core.worker.op_timing`; the row ops' kernels per op, `row_op_timing`) no engine figure is below the all-portable
configuration's (every op, attention and MoE the core's Paddle code), in the same run. The model
has SmolLM2-135M-Instruct's sizes (hidden 576, 30 layers, 9 heads of 64, 3 KV heads, intermediate
1,536, vocabulary 49,152, tied embeddings) in the demo's Qwen2 layout (q/k/v biases: the random
model writer's) with random weights, in float32 and as a bf16 checkpoint. Figures, engines alternated in ABBA order, medians: time to first token of a fresh
1,024-token prompt, single-stream decode (tokens/s: ``generate`` of 65 tokens minus of 1, over 64),
and 64 requests of 128 prompt + 64 output tokens at once (output tokens/s).
"""  # noqa: E501 (printed verbatim by --help: RawDescriptionHelpFormatter)

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from fp8 import write_bf16
from linear import abba
from throughput import params

from fdplug.demo.random_model import write_random_model

SMOLLM2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "vocab_size": 49152, "max_position_embeddings": 2048, "tie_word_embeddings": True,
           "initializer_range": 0.05, "rope_theta": 100000.0, "rms_norm_eps": 1e-5}
PORTABLE = {"attention_backend": "reference", "moe_backend": "reference",
            "op_kernels": {op: f"paddle_{op}" for op in ("swiglu", "rms_norm", "fp8_linear", "linear",
                                                          "add_rms_norm", "rope", "argmax")}}


def prompt(rng: np.random.Generator, length: int) -> dict:
    return {"prompt_token_ids": rng.integers(0, SMOLLM2["vocab_size"], size=length).tolist()}


def seconds(llm, prompts: list[dict], max_tokens: int) -> float:
    start = time.perf_counter()
    llm.generate(prompts, [params(max_tokens)] * len(prompts), use_tqdm=False)
    return time.perf_counter() - start


def ttft(llm, rng) -> float:
    return seconds(llm, [prompt(rng, 1024)], 1)


def decode_tokens_per_s(llm, rng) -> float:
    return 64 / (seconds(llm, [prompt(rng, 64)], 65) - seconds(llm, [prompt(rng, 64)], 1))


def batch_tokens_per_s(llm, rng, requests: int = 64) -> float:
    return requests * 64 / seconds(llm, [prompt(rng, 128) for _ in range(requests)], 64)


def start(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, int]:
    """An engine bench's start (this one's and bench/stack.py's): ``--quick`` added and the arguments
    parsed, the engines' logs off, the CPU and its level printed. -> (arguments, ABBA pairs)."""
    parser.add_argument("--quick", action="store_true", help="3 pairs of each")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    from fdplug.plugins.cpu import isa

    print(f"CPU: {isa.model_name()}, {isa.describe()}")
    return args, 3 if args.quick else 6


def main() -> None:
    from fdplug.core.frontend.llm import LLM
    from fdplug.core.model.layers.linear import Linear
    from fdplug.core.worker.row_op_timing import ROW_OPS

    _, pairs = start(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    with tempfile.TemporaryDirectory() as tmp:
        float_dir = Path(tmp) / "smollm2-shaped"
        float_dir.mkdir()
        write_random_model(float_dir, **SMOLLM2)
        for weights, model_dir in (("float32", float_dir), ("bf16", write_bf16(float_dir, Path(tmp) / "bf16"))):
            engine_args = {"max_model_len": 2048, "max_num_seqs": 64, "num_kv_blocks": 1024}
            llms = {"selected": LLM(str(model_dir), **engine_args), "portable": LLM(str(model_dir), **PORTABLE,
                                                                                 **engine_args)}
            runner = llms["selected"].engine.runner
            portable_layers = sum(isinstance(layer, Linear) and layer.prepared is None
                                  for layer in runner.model.sublayers())
            ops = llms["selected"].engine.selection.ops
            row_ops = ", ".join(f"{op} {ops[op].name}" for op in ROW_OPS)
            print(f"{weights} weights: selected {llms['selected'].engine.selection.summary()}; linear "
                  f"{ops['linear'].name} ({portable_layers} layers on paddle's matmul, faster on their shape); "
                  f"row ops as timed: {row_ops}; decode steps: {ops['decoder_stack'].name} ("
                  f"{'fused' if runner.model.fused_stack is not None else 'layer by layer'})")
            figures = {"TTFT 1,024 tokens (s)": abba(llms, pairs, ttft),
                       "single-stream decode (tok/s)": abba(llms, pairs, decode_tokens_per_s),
                       "64 requests (output tok/s)": abba(llms, max(2, pairs // 2), batch_tokens_per_s)}
            for name, got in figures.items():
                better = (got["portable"] / got["selected"]
                          if name.startswith("TTFT") else got["selected"] / got["portable"])
                print(f"  {name}: selected {got['selected']:.2f}, all portable {got['portable']:.2f} "
                      f"-> {better:.2f}x", flush=True)
            del llms


if __name__ == "__main__":
    sys.exit(main())
