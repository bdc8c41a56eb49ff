"""Data parallel on one machine: ``fdplug serve --data-parallel-size 2`` against one engine.

    python bench/scale.py                  # bench/throughput.py's 54M Qwen2, 64 requests, 4 pairs
    python bench/scale.py --quick          # 2 pairs
    python bench/scale.py --model DIR --num-prompts 128
    python bench/scale.py --ray            # also dp2 on the Ray backend (a local Ray): startup, overhead
    python bench/scale.py --affinity       # dp2 with and without prefix affinity on shared prefixes
    python bench/scale.py --ep             # expert parallel 2 against one engine on a random MoE model

Both servers run at once on the same model (the idle one waits in a poll): ``dp1`` is one engine
on every core (its kernels use them all), ``dp2`` two engines with their own KV caches, each pinned
to its half of the cores. A run sends every request at once (streamed, ``ignore_eos``, seeded
random prompts as bench/serve.py's), through bench/serve.py's client in a ``SCHED_IDLE`` thread;
runs alternate dp1, dp2, dp2, dp1, ... and each side's median output tokens/s counts. Printed: both
medians, their ratio, TTFT p50, and how the router spread the requests over dp2's engines. Per
server also its startup (launch to /health 200) and the per-request overhead: the median latency
of 20 one-token requests sent one after the other (``--ray`` adds ``dp2-ray``, the Ray backend,
to those two; the throughput runs stay dp1 against dp2).

``--ep`` measures expert parallel instead, on a random Qwen3-MoE (16 experts, top-4; ``--model``
for another MoE checkpoint): ``ep1`` (one engine on every core) against ``ep2``
(``--expert-parallel-size 2``: each engine on one core holding 8 experts, every forward pass a
round of both). Printed: whether both give the same greedy tokens (8 prompts, 32 tokens), the
throughput pairs as above, and from ep2's engines' exit lines their passes (own and dummy) and the
exchange's share of the time in passes.

``--affinity`` measures the router's prefix affinity instead: two dp2 servers, one with
``FDPLUG_DP_PREFIX_AFFINITY=0``; a run is 8 waves of 8 requests, one per "system prompt" (8 shared
prefixes of 384 tokens, fresh each run, plus 16 tokens of its own and 32 out), each wave sent at
once after the previous finished; runs alternate between the servers. Printed per server: the
prefix cache hit rate of its runs (hit tokens / prompt tokens, from /metrics), output tokens/s and
TTFT p50, medians.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve import launch, run_client, run_rate, stop, summarize, workload


def start(model: str, dp: int, max_num_seqs: int, log: Path, backend: str = "mp",
          env: dict | None = None, ep: int = 1) -> tuple[subprocess.Popen, str]:
    """bench/serve.py's `launch` of a ``dp``-engine server (``ep``: expert parallel size); its
    startup time goes to STARTUP."""
    started = time.monotonic()
    parallel = ["--expert-parallel-size", str(ep)] if ep > 1 else ["--data-parallel-size", str(dp),
                                                                    "--data-parallel-backend", backend]
    proc, url = launch(["--model", model, "--served-model-name", "bench", "--max-num-seqs", str(max_num_seqs),
                        "--max-model-len", "1024", *parallel], log, env)
    STARTUP[url] = time.monotonic() - started
    return proc, url


STARTUP: dict[str, float] = {}


def overhead_ms(url: str, n: int = 20) -> float:
    """Median latency of one-token requests, one at a time: the per-request path's cost."""
    seconds = []
    with httpx.Client(timeout=30) as client:
        for i in range(n + 2):
            start = time.perf_counter()
            reply = client.post(url + "/v1/completions", json={"model": "bench", "prompt": [5, 6, 7, i],
                                                               "max_tokens": 1, "temperature": 0})
            reply.raise_for_status()
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[2:]) * 1e3


def prefix_counts(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    get = lambda name: float(re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))  # noqa: E731
    return get("fdplug:prefix_cache_hits_total"), get("fdplug:prefix_cache_queries_total")


def affinity(args, model: str, tmp: Path, vocab: int) -> None:
    import numpy as np

    servers = {name: start(model, 2, args.max_num_seqs, tmp / f"{name}.log",
                           env={"FDPLUG_DP_PREFIX_AFFINITY": flag})
               for name, flag in (("affinity", "1"), ("load-only", "0"))}
    try:
        got: dict[str, list[tuple[float, float, float]]] = {name: [] for name in servers}
        for i in range(2 * args.pairs):
            rng = np.random.default_rng(1000 + i)
            prefixes = [rng.integers(0, vocab, 384).tolist() for _ in range(8)]
            for name in (list(servers) if i % 2 == 0 else list(servers)[::-1]):
                url = servers[name][1]
                hits0, queries0 = prefix_counts(url)
                results, seconds = [], 0.0
                for wave in range(8):
                    prompts = [p + rng.integers(0, vocab, 16).tolist() for p in prefixes]
                    wave_results, duration = run_client(run_rate(url, "bench", prompts, [32] * 8, float("inf"), wave))
                    results += wave_results
                    seconds += duration
                time.sleep(1.5)    # the engines' stats (every 0.25-1 s) reach /metrics
                hits1, queries1 = prefix_counts(url)
                row = summarize("inf", results, seconds)
                got[name].append(((hits1 - hits0) / max(1.0, queries1 - queries0), row["out_tok_per_s"],
                                  row["ttft_p50"]))
        print(f"8 waves x 8 requests (8 shared 384-token prefixes), {2 * args.pairs} runs each, medians:")
        for name, rows in got.items():
            print(f"  {name:9s}: prefix cache hit rate {statistics.median(r[0] for r in rows):.0%}, "
                  f"{statistics.median(r[1] for r in rows):.1f} output tok/s, TTFT p50 "
                  f"{statistics.median(r[2] for r in rows):.1f} ms")
    finally:
        stop(servers)


def make_moe_model(tmp: Path) -> str:
    """A random Qwen3-MoE of ~60M parameters: 4 layers, 16 experts of width 512, top-4."""
    from fdplug.demo.random_model import write_random_model

    out = tmp / "moe"
    out.mkdir()
    write_random_model(out, architectures=["Qwen3MoeForCausalLM"], hidden_size=512, intermediate_size=1024,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, num_experts=16,
                       num_experts_per_tok=4, moe_intermediate_size=512, norm_topk_prob=True,
                       decoder_sparse_step=1, initializer_range=0.1)
    return str(out)


def greedy_tokens(url: str, prompts: list[list[int]], n: int = 32) -> list[list[str]]:
    with httpx.Client(timeout=120) as client:
        return [client.post(url + "/v1/completions", json={
            "model": "bench", "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 1,
        }).json()["choices"][0]["logprobs"]["tokens"] for p in prompts]


def expert_parallel(args, tmp: Path, pairs: int) -> None:
    import numpy as np

    model = args.model or make_moe_model(tmp)
    from fdplug.core.model.checkpoint.config import ModelConfig

    vocab = ModelConfig.from_dir(model).vocab_size
    servers = {"ep1": start(model, 1, args.max_num_seqs, tmp / "ep1.log"),
               "ep2": start(model, 2, args.max_num_seqs, tmp / "ep2.log", ep=2)}
    try:
        rng = np.random.default_rng(7)
        prompts = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(8, 200, 8)]
        tokens = {name: greedy_tokens(url, prompts) for name, (_, url) in servers.items()}
        same = sum(a == b for a, b in zip(tokens["ep1"], tokens["ep2"]))
        print(f"greedy tokens: {same} of {len(prompts)} prompts identical (32 tokens each)", flush=True)
        throughput_pairs(args, servers, vocab, pairs)
    finally:
        stop(servers)
    for line in (tmp / "ep2.log").read_text(errors="replace").splitlines():
        if "passes of its own" in line:
            print("  " + line.split(": ", 1)[1])


def throughput_pairs(args, servers: dict, vocab: int, pairs: int) -> dict[str, float]:
    """Every request at once, alternating servers for ``pairs`` rounds; prints and returns the medians."""
    prompts, outputs = workload(args, vocab, seed=10_000)
    for _, url in servers.values():    # warm-up: one full run each
        run_client(run_rate(url, "bench", prompts, outputs, float("inf"), 0))
    got: dict[str, list[dict]] = {name: [] for name in servers}
    order = list(servers)
    for i in range(pairs):
        for name in (order if i % 2 == 0 else order[::-1]):
            prompts, outputs = workload(args, vocab, seed=i)
            results, duration = run_client(run_rate(servers[name][1], "bench", prompts, outputs, float("inf"), i))
            got[name].append(summarize("inf", results, duration))
    tput = {name: statistics.median(r["out_tok_per_s"] for r in rows) for name, rows in got.items()}
    ttft = {name: statistics.median(r["ttft_p50"] for r in rows) for name, rows in got.items()}
    print(f"{args.num_prompts} requests at once, ~{args.input_len} in / ~{args.output_len} out,"
          f" {pairs} pairs, medians:")
    for name in servers:
        print(f"  {name}: {tput[name]:7.1f} output tok/s, TTFT p50 {ttft[name]:7.1f} ms")
    first, second = order
    print(f"  {second} / {first} throughput: {tput[second] / tput[first]:.2f}x; requests per engine of {second}: "
          f"{routed(servers[second][1])}")
    return tput


def routed(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^fdplug:engine_requests_total\{engine="(\d+)"[^}]*\} (\S+)$', text, re.M)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: bench/throughput.py's 54M Qwen2)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="2 pairs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ray", action="store_true", help="also dp2 on the Ray backend: startup and overhead")
    ap.add_argument("--affinity", action="store_true", help="only the prefix-affinity comparison")
    ap.add_argument("--ep", action="store_true", help="only expert parallel 2 against one engine (a MoE model)")
    args = ap.parse_args()
    pairs = 2 if args.quick else args.pairs
    with tempfile.TemporaryDirectory() as tmp:
        if args.ep:
            return expert_parallel(args, Path(tmp), pairs)
        model = args.model
        if model is None:
            from throughput import make_model

            model = str(make_model(Path(tmp)))
        from fdplug.core.model.checkpoint.config import ModelConfig

        vocab = ModelConfig.from_dir(model).vocab_size
        if args.affinity:
            return affinity(args, model, Path(tmp), vocab)
        servers = {name: start(model, dp, args.max_num_seqs, Path(tmp) / f"{name}.log")
                   for name, dp in (("dp1", 1), ("dp2", 2))}
        if args.ray:
            servers["dp2-ray"] = start(model, 2, args.max_num_seqs, Path(tmp) / "dp2-ray.log", backend="ray")
        try:
            for name, (_, url) in servers.items():
                print(f"  {name}: startup {STARTUP[url]:.1f} s, one-token request {overhead_ms(url):.1f} ms (median "
                      "of 20, one at a time)", flush=True)
            if "dp2-ray" in servers:               # only startup and overhead: stopped before the throughput runs
                stop([servers.pop("dp2-ray")])
            throughput_pairs(args, servers, vocab, pairs)
        finally:
            stop(servers)


if __name__ == "__main__":
    sys.exit(main())
