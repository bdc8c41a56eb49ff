"""The cpu plugin's linear kernel, float32 and bf16 weights, against paddle's matmul; decode against its bound.

    python bench/linear.py            # bench/throughput.py's 54M Qwen2
    python bench/linear.py --quick    # fewer pairs

The model is written twice: float32, and the same weights rounded to bf16 (a bf16 checkpoint,
which ``dtype=auto`` serves with bf16 weights). Four engines: ``bf16`` (the selected linear kernel:
``cpu_native_bf16_linear``'s bf16 math where the CPU has AVX512-BF16), ``bf16-f32`` (bf16 weights
widened in registers, float32 math: ``cpu_native_linear``), ``float32`` through ``cpu_native_linear``
(AVX-512 outer-product tiles on weights packed at load), ``bf16-inplace`` and ``f32-inplace``
(the same kernels with ``FDPLUG_CPU_PACK_WEIGHTS=0``: dot-product tiles on the checkpoint's
``[out, in]`` layout), and ``paddle`` (float32 through the portable op, paddle's MKL matmul: the
baseline). Isolated GEMMs: ``bench/gemm.py``. Figures, all measured in this run, engines alternated in ABBA order,
medians:

1. loaded weight bytes;
2. the forward of a decode step at 1, 16 and 64 running requests;
3. single-stream decode, end to end (``generate`` of 129 tokens minus ``generate`` of 1 on fresh
   prompts of 64 tokens, over 128): tokens/s, and the fraction of the memory-bandwidth bound
   reached, the bound being the bytes a decode step must read (every weight once, plus the KV
   cache so far) over the read bandwidth measured in this run (`bench/moe.py`'s ``read_bandwidth``),
   and the engine's own work (schedule + prepare + sample) as a share of the step;
4. time to first token of a fresh 1,024-token prompt.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from fp8 import decode_forward, write_bf16
from moe import read_bandwidth
from throughput import MODEL, make_model, params

DECODE_TOKENS, PROMPT = 128, 64


def fresh_prompt(rng: np.random.Generator, length: int) -> dict:
    return {"prompt_token_ids": rng.integers(0, MODEL["vocab_size"], size=length).tolist()}


def generate_seconds(llm, prompt: dict, max_tokens: int) -> float:
    start = time.perf_counter()
    llm.generate([prompt], [params(max_tokens)], use_tqdm=False)
    return time.perf_counter() - start


def abba(llms: dict, pairs: int, measure) -> dict[str, float]:
    """Median of ``measure(llm, rng)`` per engine, engines alternated in ABBA order."""
    rng = np.random.default_rng(0)
    got: dict[str, list[float]] = {name: [] for name in llms}
    names = list(llms)
    for i in range(pairs):
        for name in (names if i % 2 == 0 else names[::-1]):
            got[name].append(measure(llms[name], rng))
    return {name: statistics.median(v) for name, v in got.items()}


def decode_step_seconds(llm, rng) -> float:
    """Seconds per decoded token of one request, end to end, prefill excluded."""
    full = generate_seconds(llm, fresh_prompt(rng, PROMPT), DECODE_TOKENS + 1)
    first = generate_seconds(llm, fresh_prompt(rng, PROMPT), 1)
    return (full - first) / DECODE_TOKENS


def host_share(llm) -> float:
    """The engine's own work (schedule + prepare + sample, as its profiler times them) as a share of
    a single-stream decode step (all phases): the issue's ceiling is 5%."""
    before = llm.engine.profiler.snapshot()
    generate_seconds(llm, fresh_prompt(np.random.default_rng(7), PROMPT), DECODE_TOKENS + 1)
    spent = {k: v - before.get(k, 0.0) for k, v in llm.engine.profiler.snapshot().items()}
    return (spent["schedule"] + spent["prepare"] + spent["sample"]) / sum(spent.values())


def step_bytes(llm) -> int:
    """What one decode step must read: every weight, and the KV cache of the context (float32)."""
    cfg = llm.model_config
    context = PROMPT + DECODE_TOKENS // 2
    kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * context
    return llm.engine.runner.model_bytes + kv


def times(seconds: dict[str, float]) -> str:
    return ", ".join(f"{name} {s * 1e3:.1f} ms" for name, s in seconds.items())


def speedups(t: dict[str, float]) -> str:
    """The comparisons that matter: bf16 math against float32 math on the same bf16 weights, bf16
    weights against float32 ones, the kernel against paddle's matmul."""
    return (f"bf16 math/f32 math {t['bf16-f32'] / t['bf16']:.2f}x, "
            f"bf16-f32/float32 {t['float32'] / t['bf16-f32']:.2f}x, "
            f"float32/paddle {t['paddle'] / t['float32']:.2f}x, packed/in-place float32 "
            f"{t['f32-inplace'] / t['float32']:.2f}x, bf16 {t['bf16-inplace'] / t['bf16']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 pairs of each")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    from fdplug.core.frontend.llm import LLM

    pairs = 3 if args.quick else 8
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        float_dir = make_model(root)
        bf16_dir = write_bf16(float_dir, root / "bf16")
        engine_args = {"max_model_len": 2048, "max_num_seqs": 64, "num_kv_blocks": 1024}
        llms = {"bf16": LLM(str(bf16_dir), **engine_args),
                "bf16-f32": LLM(str(bf16_dir), op_kernels={"linear": "cpu_native_linear"}, **engine_args),
                "float32": LLM(str(float_dir), **engine_args),
                "paddle": LLM(str(float_dir), op_kernels={"linear": "paddle_linear"}, **engine_args)}
        os.environ["FDPLUG_CPU_PACK_WEIGHTS"] = "0"
        llms |= {"bf16-inplace": LLM(str(bf16_dir), **engine_args), "f32-inplace": LLM(str(float_dir), **engine_args)}
        del os.environ["FDPLUG_CPU_PACK_WEIGHTS"]
        assert llms["f32-inplace"].engine.runner.model.layers[0].mlp.down_proj.prepared is None
        assert llms["float32"].engine.runner.model.layers[0].mlp.down_proj.prepared is not None
        assert llms["bf16"].config.weight_dtype == "bfloat16" and llms["float32"].config.weight_dtype == "float32"
        size = {name: llm.engine.runner.model_bytes for name, llm in llms.items()}
        assert llms["paddle"].engine.selection.ops["linear"].name == "paddle_linear"
        print(f"model: bench/throughput.py's random Qwen2 ({MODEL['num_hidden_layers']} layers, hidden "
              f"{MODEL['hidden_size']}, vocab {MODEL['vocab_size']}, tied embeddings), kernels: "
              f"{llms['bf16'].engine.selection.ops['linear'].name}")
        print(f"1. loaded weights: bf16 {size['bf16'] / 1e6:.1f} MB, float32 {size['float32'] / 1e6:.1f} MB "
              f"(ratio {size['bf16'] / size['float32']:.2f})")
        for running in (1, 16, 64):
            t = decode_forward(llms, running, pairs=pairs)
            print(f"2. decode step forward, {running:2d} running: {times(t)}; {speedups(t)}")
        bandwidth = read_bandwidth()
        step = abba(llms, pairs, decode_step_seconds)
        for name, seconds in step.items():
            bound = step_bytes(llms[name]) / bandwidth
            print(f"3. single-stream decode, {name:7s}: {1 / seconds:6.1f} tok/s ({seconds * 1e3:.2f} ms/token); "
                  f"bound {bound * 1e3:.2f} ms ({step_bytes(llms[name]) / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s): "
                  f"{bound / seconds:.0%} of it")
        print(f"   decode speed: {speedups(step)}")
        print("   engine work (schedule + prepare + sample) in a single-stream step: "
              + ", ".join(f"{name} {host_share(llm):.1%}" for name, llm in llms.items()) + " (target <= 5%)")
        ttft = abba(llms, pairs, lambda llm, rng: generate_seconds(llm, fresh_prompt(rng, 1024), 1))
        print(f"4. TTFT, fresh 1024-token prompt: {times(ttft)}; {speedups(ttft)}")


if __name__ == "__main__":
    sys.exit(main())
