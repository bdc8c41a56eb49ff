"""Isolated linear layers: the cpu kernels on packed weights, on weights in place, and paddle's matmul.

    python bench/gemm.py            # bench/throughput.py's layer shapes, 1 to 1,024 rows
    python bench/gemm.py --quick    # fewer repetitions

The issue's question for the GEMMs: measure the library's best against our own kernels, keep the
faster. Per shape (``[N, K]`` weights of the bench model's layers) and row count, GFLOP/s of:
``packed`` (csrc/linear_packed.c on weights packed at load: what the engine runs), ``inplace``
(csrc/linear.c on the checkpoint's ``[N, K]``: ``FDPLUG_CPU_PACK_WEIGHTS=0``), ``paddle``
(``paddle.matmul(x, w, transpose_y=True)``: MKL, on as many threads as the kernels), for float32
weights, bf16 weights in float32 math, and bf16 math (``cpu_native_bf16_linear``; paddle has no
CPU bf16 matmul to compare). All in this run, the variants alternated (ABAB...) and the median of
each taken: this machine drifts, so only the ratios within a line mean anything.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from throughput import MODEL

ROWS = (1, 16, 64, 256, 1024)


def shapes() -> list[tuple[int, int]]:
    """The bench model's linear layers, [N, K]: fused qkv, o, gate/up, down."""
    h, i = MODEL["hidden_size"], MODEL["intermediate_size"]
    heads, kv, d = MODEL["num_attention_heads"], MODEL["num_key_value_heads"], h // MODEL["num_attention_heads"]
    return [((heads + 2 * kv) * d, h), (h, heads * d), (2 * i, h), (h, i)]


def seconds(call, budget: float) -> float:
    """One timing: as many calls as fit in ``budget`` seconds (at least 3), per call."""
    call()
    n, start = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - start < budget:
        call()
        n += 1
    return (time.perf_counter() - start) / n


def compare(calls: dict, flops: float, rounds: int, budget: float) -> dict[str, float]:
    got: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            got[name].append(seconds(calls[name], budget))
    return {name: flops / statistics.median(v) / 1e9 for name, v in got.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter repetitions")
    args = parser.parse_args()
    import paddle

    from fdplug.plugins.cpu import device, native_linear

    device.setup()
    threads = device.cpu_threads()
    rounds, budget = (4, 0.05) if args.quick else (8, 0.1)
    bf16_math = native_linear.bf16_math_available()
    print(f"{threads} threads; GFLOP/s, medians of {rounds} interleaved timings; 'x' = packed / best other")
    rng = np.random.default_rng(0)
    for n, k in shapes():
        w = paddle.to_tensor(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
        wb = w.astype("bfloat16")
        packed, packed_b = native_linear.prepare(w), native_linear.prepare(wb)
        for rows in ROWS:
            x = paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32))
            flops = 2.0 * rows * n * k
            f32 = compare({"packed": lambda: native_linear.linear(x, packed, threads),
                           "inplace": lambda: native_linear.linear(x, w, threads),
                           "paddle": lambda: paddle.matmul(x, w, transpose_y=True)}, flops, rounds, budget)
            b16 = compare({"packed": lambda: native_linear.linear(x, packed_b, threads),
                           "inplace": lambda: native_linear.linear(x, wb, threads)}, flops, rounds, budget)
            line = (f"[{n:4d}, {k:4d}] {rows:4d} rows | float32 packed {f32['packed']:6.1f} inplace {f32['inplace']:6.1f} "
                    f"paddle {f32['paddle']:6.1f} ({f32['packed'] / max(f32['inplace'], f32['paddle']):.2f}x) | "
                    f"bf16 weights packed {b16['packed']:6.1f} inplace {b16['inplace']:6.1f} "
                    f"({b16['packed'] / b16['inplace']:.2f}x)")
            if bf16_math:
                dot = compare({"packed": lambda: native_linear.linear(x, packed_b, threads, bf16_math=True),
                               "inplace": lambda: native_linear.linear(x, wb, threads, bf16_math=True)},
                              flops, rounds, budget)
                line += (f" | bf16 math packed {dot['packed']:6.1f} inplace {dot['inplace']:6.1f} "
                         f"({dot['packed'] / dot['inplace']:.2f}x)")
            print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
