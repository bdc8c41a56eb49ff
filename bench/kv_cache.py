"""The cpu decode attention kernel over a float32, float16 and bfloat16 KV cache (``--kv-cache-dtype``).

    python bench/kv_cache.py                 # 64 sequences, SmolLM2-135M's heads (9 of 64, 3 KV heads)
    python bench/kv_cache.py --keys 144,300,400,1000 --seqs 64
    python bench/kv_cache.py --layers 30 --scatter   # as in a running engine: 30 layers' caches, blocks scattered

Why: decode attention at many streams reads every key and value of every sequence once a layer,
and from a few hundred keys those bytes come from memory: a 2-byte cache halves them. Per context
length: milliseconds a layer for one decode step of ``--seqs`` sequences (the step's 30 layers are 30
of these), the cache bytes read per second, and each 2-byte type against float32. With ``--layers
N`` each call reads the next of N caches (a step's layers: the bytes then come from memory, not
from the L3 that one layer's cache fits in), and ``--scatter`` shuffles the block tables, as a
running engine's block pool leaves them (a sequence's blocks taken as it grows). The dtypes
alternate (ABC ABC ...), medians kept: this machine drifts. The first line names the CPU and the
level the kernels were built for.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

DTYPES = ("float32", "float16", "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", default="144,300,400", help="context lengths (keys a sequence)")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=1, help="caches read in turn, one a call (a step's layers)")
    parser.add_argument("--scatter", action="store_true", help="blocks in a random order, as a busy block pool")
    args = parser.parse_args()

    from fdplug.plugins.cpu import device, isa

    threads = device.cpu_threads()
    print(f"CPU: {isa.model_name()}, kernels built for {isa.describe()}; {threads} threads")
    rng = np.random.default_rng(0)
    for keys in (int(k) for k in args.keys.split(",")):
        print(one_length(keys, args, rng, threads))


def one_length(keys: int, args: argparse.Namespace, rng: np.random.Generator, threads: int) -> str:
    """The line for one context length: every dtype's median layer time, bytes a second, ratio."""
    import paddle

    from fdplug.plugins.cpu import kernels

    block = 16
    blocks_per_seq = -(-keys // block)
    shape = (args.kv_heads, args.seqs * blocks_per_seq + 1, block, args.dim)
    floats = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    caches = {dtype: [[paddle.to_tensor(f).astype(dtype) for f in floats] for _ in range(args.layers)]
              for dtype in DTYPES}
    q = paddle.to_tensor(rng.standard_normal((args.seqs, args.heads, args.dim)).astype(np.float32))
    order = 1 + np.arange(args.seqs * blocks_per_seq, dtype=np.int32)
    if args.scatter:
        order = rng.permutation(order).astype(np.int32)
    tables = order.reshape(args.seqs, blocks_per_seq)
    rows = np.arange(args.seqs, dtype=np.int32)
    key_end = np.full(args.seqs, keys, np.int32)

    def layer(dtype: str) -> float:
        start, calls = time.perf_counter(), max(10, args.layers)
        for call in range(calls):
            key_cache, value_cache = caches[dtype][call % args.layers]
            kernels.paged_attention(q, key_cache, value_cache, rows, tables, rows, key_end, keys, args.dim ** -0.5,
                                    threads)
        return (time.perf_counter() - start) / calls

    times: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    for dtype in DTYPES:
        layer(dtype)                      # warm up
    for _ in range(args.rounds):
        for dtype in DTYPES:
            times[dtype].append(layer(dtype))
    medians = {dtype: statistics.median(t) for dtype, t in times.items()}
    parts = []
    for dtype in DTYPES:
        read = args.seqs * keys * args.kv_heads * args.dim * 2 * (4 if dtype == "float32" else 2)
        ratio = "" if dtype == "float32" else f" ({medians['float32'] / medians[dtype]:.2f}x float32)"
        parts.append(f"{dtype} {medians[dtype] * 1e3:6.3f} ms {read / medians[dtype] / 1e9:5.1f} GB/s{ratio}")
    return f"{keys:5d} keys x {args.seqs} seqs: " + " | ".join(parts)

if __name__ == "__main__":
    main()
