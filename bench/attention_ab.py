"""Two builds of the cpu kernel library against each other on paged decode attention, in one process.

    python bench/attention_ab.py --a OLD.so --b NEW.so                      # 64 sequences, 256/512/1,024 keys
    python bench/attention_ab.py --a OLD.so --b NEW.so --seqs 1 --keys 3000 --kv-cache-dtype float32

Why: a change to the attention kernel's memory access is worth a few percent, and this machine drifts
by more than that between two runs of a process (AMD EPYC, avx2-or-less: +-15-30%). Both libraries
are loaded into one process (ctypes) and their ``fdplug_paged_attention`` calls alternate (A B B A
..., `gemm.median_seconds`) on the same query rows and caches; the median time of each is kept and
B's time over A's printed (below 1: B is faster). Their outputs are compared first: two builds that
differ in their bits are refused. As in a running engine, each call reads the next of ``--layers``
caches (a decode step's layers: the bytes come from memory) and the block tables are shuffled (a
busy block pool hands a sequence its blocks as it grows); each sequence has between half of
``--keys`` and all of them, as a batch's sequences differ. SmolLM2-135M's heads by default.
"""

from __future__ import annotations

import argparse
import ctypes

import numpy as np
from gemm import add_build_ab_arguments, compare_builds, cycled, start_build_ab  # (ABBA..., medians)

DTYPES = {"float32": (np.float32, 0), "float16": (np.float16, 1)}   # numpy type, kernels.KV_TYPES index


def caches(args, keys: int, rng) -> tuple[list, np.ndarray, np.ndarray, int]:
    """(``--layers`` (key, value) caches, shuffled block tables, each sequence's key count, the blocks a table row)"""
    width = -(-keys // args.block_size)
    blocks = args.seqs * width + 1
    shape = (args.kv_heads, blocks, args.block_size, args.dim)
    dtype = DTYPES[args.kv_cache_dtype][0]
    layers = [(rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))
              for _ in range(args.layers)]
    tables = rng.permutation(np.arange(1, blocks, dtype=np.int32))[: args.seqs * width].reshape(args.seqs, width)
    key_end = rng.integers(keys // 2, keys + 1, args.seqs).astype(np.int32)
    return layers, np.ascontiguousarray(tables), key_end, width


def line(args, keys: int) -> str:
    from fdplug.plugins.cpu import kernels

    rng = np.random.default_rng(0)
    layers, tables, key_end, width = caches(args, keys, rng)
    q = rng.standard_normal((args.seqs, args.heads, args.dim)).astype(np.float32)
    rows = np.arange(args.seqs, dtype=np.int32)
    out = np.zeros_like(q)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    blocks, kv_type = layers[0][0].shape[1], DTYPES[args.kv_cache_dtype][1]

    def caller(path: str):
        attend = ctypes.CDLL(path).fdplug_paged_attention
        attend.restype, attend.argtypes = kernels.SIGNATURES["fdplug_paged_attention"]
        layer = cycled(layers)   # each call the next layer's caches

        def call() -> None:
            k, v = layer()
            if attend(ptr(q), ptr(k), ptr(v), ptr(rows), ptr(tables), ptr(rows), ptr(key_end), ptr(out), args.seqs,
                      args.heads, args.kv_heads, args.dim, blocks, args.block_size, width, keys,
                      args.dim ** -0.5, args.threads, kv_type) != 0:
                raise SystemExit(f"{path} failed ({args.seqs} sequences of <= {keys} keys)")
        return call

    calls = {"A": caller(args.a), "B": caller(args.b)}
    # (each build's calls end on layer 0 again: both outputs from the same caches)
    a, b = compare_builds(calls, out.copy, f"{keys} keys", args, warm=len(layers))
    read = 2 * args.kv_heads * int(key_end.sum()) * args.dim * np.dtype(DTYPES[args.kv_cache_dtype][0]).itemsize
    return (f"{args.seqs} seqs x <= {keys:5d} keys, {args.kv_cache_dtype} | A {a * 1e6:8.1f} us "
            f"{read / a / 1e9:5.1f} GB/s | B {b * 1e6:8.1f} us {read / b / 1e9:5.1f} GB/s | B/A time {b / a:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_build_ab_arguments(parser)   # --a, --b, --rounds, --budget, --threads
    parser.add_argument("--keys", default="256,512,1024", help="comma-separated most keys a sequence")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-dtype", choices=sorted(DTYPES), default="float16")
    parser.add_argument("--layers", type=int, default=8, help="caches read in turn, one a call (a step's layers)")
    args = parser.parse_args()
    start_build_ab(args)
    for keys in (int(k) for k in args.keys.split(",")):
        print(line(args, keys), flush=True)


if __name__ == "__main__":
    main()
