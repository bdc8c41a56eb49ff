"""MoE on CPU: fdplug against Hugging Face ``generate()``, cpu_native against the reference backend,
and the MoE layer against the memory-bandwidth bound. Ratios measured in one run.

    python bench/moe.py                                   # HF baseline in this interpreter, if it has torch
    python bench/moe.py --hf-python /path/venv/bin/python # HF baseline in another venv (torch + transformers)
    python bench/moe.py --quick                           # 32 requests, fewer pairs, no HF

The model is a random-weight Qwen3-MoE (6 layers, 32 experts of width 384, top-4, hidden 512,
~150M parameters, float32), written with the demo tokenizer. Three figures:

1. output tok/s of fdplug (cpu_native MoE) vs HF ``generate()`` (batches of 64, left-padded) on 128
   mixed-length requests, as ``bench/throughput.py`` does (target >= 3x);
2. decode step time at 64 running requests, cpu_native vs reference MoE backend, two engines side
   by side, interleaved A/B blocks of steps, median per-step forward time (target >= 3x);
3. one MoE layer's routed experts at batch 1 (and 64), timed alone, against the bound of reading
   the active experts' weights once at this machine's measured read bandwidth (aim: within 2x).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from throughput import params, run_fdplug, workload  # bench/throughput.py: the same 128 mixed requests

MODEL = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 512,
         "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 64, "vocab_size": 32000, "initializer_range": 0.05, "max_position_embeddings": 4096,
         "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 384, "norm_topk_prob": True,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}

HF_WORKER = r"""
import json, os, sys, time
import torch
from transformers import AutoModelForCausalLM
model_dir, job = sys.argv[1], json.load(open(sys.argv[2]))
torch.set_num_threads(os.cpu_count() or 1)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
prompts, outputs, pad = job["prompts"], job["outputs"], 0
start, counted = time.perf_counter(), 0
for i in range(0, len(prompts), 64):
    batch, wants = prompts[i:i + 64], outputs[i:i + 64]
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(wants), min_new_tokens=max(wants),
                       do_sample=False, pad_token_id=pad)
    counted += sum(wants)
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": counted,
                  "experts": getattr(model.config, "_experts_implementation_internal", None)}))
"""


def make_model(root: Path) -> Path:
    from fdplug.demo.random_model import write_random_model

    path = root / "qwen3-moe-150m"
    path.mkdir()
    write_random_model(path, **MODEL)
    return path


def run_hf(python: str, model_dir: Path, prompts, outputs) -> tuple[float, int] | None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "outputs": outputs}, f)
    try:
        done = subprocess.run([python, "-c", HF_WORKER, str(model_dir), f.name], capture_output=True, text=True,
                              timeout=3600, check=False)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        print(f"HF baseline failed or skipped ({python}): {done.stderr.strip().splitlines()[-1:]}")
        return None
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"   HF experts implementation: {result.get('experts')} (transformers' default for this torch)")
    return result["seconds"], result["tokens"]


def decode_steps(llms: dict, pairs: int, steps: int = 6) -> dict[str, float]:
    """Median forward seconds per decode step at 64 running requests, engines alternated in ABBA blocks."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, MODEL["vocab_size"], size=32).tolist() for _ in range(64)]
    for llm in llms.values():
        for p in prompts:
            llm._submit(_prompt(p), params(pairs * steps + 16))
        for _ in range(8):   # past the prefill
            llm._step()
    per_step: dict[str, list[float]] = {name: [] for name in llms}
    names = list(llms)
    for i in range(pairs):
        for name in (names if i % 2 == 0 else names[::-1]):
            llm = llms[name]
            before = llm.engine.profiler.snapshot()["forward"]
            for _ in range(steps):
                llm._step()
            per_step[name].append((llm.engine.profiler.snapshot()["forward"] - before) / steps)
    return {name: statistics.median(v) for name, v in per_step.items()}


def _prompt(tokens):
    from fdplug.core.frontend.processor import ProcessedPrompt

    return ProcessedPrompt(None, tokens)


def read_bandwidth() -> float:
    """Bytes/s of reading a 512 MiB float32 array, best of 5, one thread and all cores.

    numpy's sum streams its input once and releases the GIL, so one sum per core over its own
    slice reads the array with every core, as the MoE kernel does. The larger figure makes the
    tighter (more honest) bound.
    """
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(128 << 20, dtype=np.float32)
    cores = os.cpu_count() or 1
    slices = np.array_split(a, cores)
    best = 0.0
    with ThreadPoolExecutor(cores) as pool:
        for threads in (1, cores) * 5:
            start = time.perf_counter()
            if threads == 1:
                a.sum()
            else:
                list(pool.map(np.sum, slices))
            best = max(best, a.nbytes / (time.perf_counter() - start))
    return best


def layer_vs_bound(llm, tokens: int, bandwidth: float, repeats: int = 30) -> tuple[float, float, float]:
    """Median seconds of one MoE layer's routed experts for ``tokens`` random rows, the bandwidth bound
    for the experts they touch, and the mean number touched.

    Each repeat takes the next MoE layer and fresh random rows, after reading a buffer larger than
    any cache: the experts' weights come from memory, as in a real step, not from the L3 where the
    previous repeat left them.
    """
    import paddle

    from fdplug.core.portable.moe_routing import select_experts

    cfg = llm.model_config
    blocks = [llm.engine.runner.model.layers[i].mlp for i in cfg.moe.layers]
    expert_bytes = 3 * cfg.moe.intermediate_size * cfg.hidden_size * 4
    evict = np.ones(64 << 20, dtype=np.float32)
    times, bounds, touched = [], [], []
    for r in range(repeats):
        block = blocks[r % len(blocks)]
        x = paddle.randn([tokens, cfg.hidden_size])
        weights, ids = select_experts(paddle.matmul(x, block.router), block.routing)
        touched.append(len(np.unique(ids.numpy())))
        evict.sum()
        start = time.perf_counter()
        block.backend.forward(x, weights, ids, block.experts).numpy()
        times.append(time.perf_counter() - start)
        bounds.append(touched[-1] * expert_bytes / bandwidth)
    return statistics.median(times), statistics.median(bounds), float(np.mean(touched))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--hf-python", default=sys.executable, help="interpreter with torch + transformers")
    parser.add_argument("--quick", action="store_true", help="32 requests, 3 pairs, no HF")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    from fdplug.core.frontend.llm import LLM

    n = 32 if args.quick else args.num_requests
    engine_args = dict(max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_memory=2.0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp))
        llm = LLM(str(model_dir), moe_backend="cpu_native", **engine_args)
        cfg = llm.model_config
        total = sum(int(np.prod(p.shape)) for p in llm.engine.runner.model.parameters()) + \
            cfg.moe.expert_parameters(cfg.hidden_size)
        prompts, outputs = workload(n)
        print(f"model: random Qwen3-MoE, {total / 1e6:.0f}M parameters ({cfg.moe.num_experts} experts x "
              f"{len(cfg.moe.layers)} layers, top-{cfg.moe.routing.top_k}); {n} requests, prompts 64-512, outputs "
              f"32-256 ({sum(outputs)} tokens), greedy, ignore_eos")

        run_fdplug(llm, prompts[:4], [4] * 4)   # warm-up
        elapsed, produced = run_fdplug(llm, prompts, outputs)
        ours = produced / elapsed
        print(f"1. fdplug (cpu_native MoE): {ours:.1f} output tok/s ({elapsed:.1f} s)")
        if not args.quick:
            hf = run_hf(args.hf_python, model_dir, prompts, outputs)
            if hf is not None:
                print(f"   HF generate (batches of 64): {hf[1] / hf[0]:.1f} output tok/s ({hf[0]:.1f} s); "
                      f"ratio {ours / (hf[1] / hf[0]):.2f}x (target >= 3x)")

        engines = {"cpu_native": llm, "reference": LLM(str(model_dir), moe_backend="reference", **engine_args)}
        steps = decode_steps(engines, pairs=3 if args.quick else 8)
        print(f"2. decode step forward at 64 requests (median of ABBA blocks): cpu_native "
              f"{steps['cpu_native'] * 1e3:.1f} ms, reference {steps['reference'] * 1e3:.1f} ms; "
              f"ratio {steps['reference'] / steps['cpu_native']:.2f}x (target >= 3x)")
        del engines["reference"]

        bandwidth = read_bandwidth()
        for tokens in (1, 64):
            took, bound, touched = layer_vs_bound(llm, tokens, bandwidth)
            print(f"3. one MoE layer's experts, {tokens} token(s), {touched:.1f} experts touched: {took * 1e6:.0f} us; "
                  f"bound {bound * 1e6:.0f} us at {bandwidth / 1e9:.1f} GB/s read; ratio {took / bound:.2f} "
                  f"(aim <= 2 at batch 1)")


if __name__ == "__main__":
    main()
