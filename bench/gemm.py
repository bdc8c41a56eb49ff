"""Isolated linear layers: the cpu kernels on packed weights, on weights in place, and paddle's matmul.

    python bench/gemm.py                    # bench/throughput.py's layer shapes, 1 to 1,024 rows
    python bench/gemm.py --quick            # fewer repetitions
    python bench/gemm.py --smollm2          # SmolLM2-135M's shapes (bench/levels.py's model)
    python bench/gemm.py --shape 49152x576 --rows 1,16,64   # other [N, K] (a tied lm_head), row counts
    FDPLUG_CPU_ISA=avx2 python bench/gemm.py  # the kernels built for x86-64-v3 (AVX2 tiles)

The issue's question for the GEMMs: measure the library's best against our own kernels, keep the
faster. Per shape (``[N, K]`` weights of the bench model's layers) and row count, GFLOP/s of:
``packed`` (csrc/linear_packed.c on weights packed at load: what the engine runs), ``inplace``
(csrc/linear.c on the checkpoint's ``[N, K]``: ``FDPLUG_CPU_PACK_WEIGHTS=0``), ``paddle``
(``paddle.matmul(x, w, transpose_y=True)``: MKL, on as many threads as the kernels), ``onednn``
(``dnnl_sgemm`` / ``dnnl_gemm_bf16bf16f32`` of the oneDNN 3 that paddle's wheel bundles,
``paddle/libs/libdnnl.so.3``, called on the same buffers; its bf16 GEMM is given the input already
rounded to bf16, a conversion the others pay inside), for float32 weights, bf16 weights in float32
math (against ``portable``: the core's op, which widens the layer and calls paddle's matmul), and
bf16 math (``cpu_native_bf16_linear``; paddle has no CPU bf16 matmul to compare). All in this run, the variants alternated (ABAB...) and the median of
each taken: this machine drifts, so only the ratios within a line mean anything. Each float32 line also
times the CPU's float32 FMA peak among its calls (``peak``: csrc/fma_peak.c, independent FMAs of the
kernels' vector width, on the same threads) and gives packed's and paddle's share of it: where
paddle's matmul already runs at 84-89% of the peak, no kernel can be 1.2x it. The first line
names the CPU and the level the kernels were built for (``FDPLUG_CPU_ISA`` caps it; paddle's MKL
and oneDNN pick their own code paths whatever the cap).
"""  # noqa: E501 (printed verbatim by --help: RawDescriptionHelpFormatter)

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import numpy as np
from throughput import MODEL

ROWS = (1, 16, 64, 256, 1024)


def shapes(model: dict = MODEL) -> list[tuple[int, int]]:
    """A model's linear layers, [N, K]: fused qkv, o, gate/up, down."""
    h, i = model["hidden_size"], model["intermediate_size"]
    heads, kv, d = model["num_attention_heads"], model["num_key_value_heads"], h // model["num_attention_heads"]
    return [((heads + 2 * kv) * d, h), (h, heads * d), (2 * i, h), (h, i)]


def onednn():
    """oneDNN's row-major GEMMs from paddle's wheel (None where the library is not there)."""
    import ctypes
    from pathlib import Path

    import paddle

    path = Path(paddle.__file__).parent / "libs" / "libdnnl.so.3"
    if not path.exists():
        return None
    lib = ctypes.CDLL(str(path))
    i64, ptr, f32, ch = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_char
    for name in ("dnnl_sgemm", "dnnl_gemm_bf16bf16f32"):
        getattr(lib, name).argtypes = [ch, ch, i64, i64, i64, f32, ptr, i64, ptr, i64, f32, ptr, i64]
        getattr(lib, name).restype = ctypes.c_int
    return lib


def dnnl_call(lib, name: str, x, w, out) -> None:
    """out [M, N] = x [M, K] @ w [N, K]^T (row-major, w transposed) through oneDNN's ``name``."""
    m, k = x.shape
    n = w.shape[0]
    status = getattr(lib, name)(b"N", b"T", m, n, k, 1.0, x.data_ptr(), k, w.data_ptr(), k, 0.0, out.data_ptr(), n)
    if status != 0:
        raise RuntimeError(f"{name} failed with status {status}")


def seconds(call, budget: float) -> float:
    """One timing: as many calls as fit in ``budget`` seconds (at least 3), per call."""
    call()
    n, start = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - start < budget:
        call()
        n += 1
    return (time.perf_counter() - start) / n


def median_seconds(calls: dict, rounds: int, budget: float) -> dict[str, float]:
    """Median seconds a call of each, the calls alternated round by round (ABBA...)."""
    got: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            got[name].append(seconds(calls[name], budget))
    return {name: statistics.median(v) for name, v in got.items()}


def add_build_ab_arguments(parser) -> None:
    """Two builds of the kernel library against each other (kernel_ab.py, attention_ab.py): which, and the timings."""
    parser.add_argument("--a", required=True, help="the baseline library (.so)")
    parser.add_argument("--b", required=True, help="the library under test (.so)")
    parser.add_argument("--rounds", type=int, default=16, help="timings of each library (alternated)")
    parser.add_argument("--budget", type=float, default=0.05, help="seconds a timing (its calls repeated)")
    parser.add_argument("--threads", type=int, default=None, help="the kernels' threads (default: the device's)")


def start_build_ab(args) -> None:
    """The cpu device set up, ``args.threads`` resolved, and the first line: the CPU, its level, the builds."""
    from fdplug.plugins.cpu import device, isa

    device.setup()
    args.threads = args.threads or device.cpu_threads()
    print(f"CPU: {isa.model_name()}, {isa.describe()}; {args.threads} threads; medians of {args.rounds} "
          f"alternated timings; A = {args.a}, B = {args.b}", flush=True)


def cycled(copies: list):
    """A function giving the next of ``copies`` at each call, round and round: a model's layers, whose
    weights come from memory, not from the cache the last call left them in."""
    turn = itertools.count()
    return lambda: copies[next(turn) % len(copies)]


def ab_line(label: str, a: float, b: float, flops: float) -> str:
    """A build A/B's line: each build's median time and GFLOP/s, and B's time over A's."""
    return (f"{label} | A {a * 1e6:9.1f} us {flops / a / 1e9:7.1f} GFLOP/s | B {b * 1e6:9.1f} us "
            f"{flops / b / 1e9:7.1f} GFLOP/s | B/A time {b / a:.3f}")


def linear_builds_line(status_call, out, label: str, flops: float, args) -> str:
    """kernel_ab.py's and linear_ab.py's line: ``status_call(name)`` gives build ``name``'s call (A, B),
    which returns the library's status and writes ``out`` (a paddle tensor); a refusal ends the run."""
    def checked(name: str):
        call = status_call(name)

        def run() -> None:
            if call() != 0:
                raise SystemExit(f"build {name} refused {label.strip()}")
        return run

    calls = {name: checked(name) for name in ("A", "B")}
    a, b = compare_builds(calls, lambda: out.numpy().copy(), label.strip(), args)
    return ab_line(label, a, b, flops)


def compare_builds(calls: dict, output, what: str, args, warm: int = 1) -> tuple[float, float]:
    """The A/B of two builds (kernel_ab.py, linear_ab.py, attention_ab.py): each build's call run
    ``warm`` times and its output kept (``output()``, a copy), the two compared (different bits are
    refused, naming ``what``), then the calls alternated (`median_seconds`): A's and B's seconds."""
    results = {}
    for name, call in calls.items():
        for _ in range(warm):
            call()
        results[name] = output()
    if not np.array_equal(results["A"], results["B"]):
        raise SystemExit(f"{what}: A and B give different bits")
    t = median_seconds(calls, args.rounds, args.budget)
    return t["A"], t["B"]


def compare(calls: dict, flops: float, rounds: int, budget: float) -> dict[str, float]:
    """GFLOP/s of each call (`median_seconds`)."""
    return {name: flops / t / 1e9 for name, t in median_seconds(calls, rounds, budget).items()}


PEAK_FLOPS = 1e8   # a timing of the FMA peak: ~0.4 ms on two cores at ~250 GFLOP/s, as a 64-row layer


def compare_with_peak(calls: dict, flops: float, threads: int, rounds: int, budget: float):
    """`compare`'s GFLOP/s of each call, and the CPU's float32 FMA peak on the same threads
    (csrc/fma_peak.c: independent FMAs of the kernels' vector width), timed among the calls: the
    ceiling the figures sit under, in this run (the machine drifts)."""
    from fdplug.plugins.cpu import kernels

    lib = kernels.load()
    done = lib.fdplug_fma_peak(PEAK_FLOPS, threads)   # what each call does (PEAK_FLOPS, rounded up)
    timed = median_seconds({**calls, "peak": lambda: lib.fdplug_fma_peak(PEAK_FLOPS, threads)}, rounds, budget)
    peak = done / timed.pop("peak") / 1e9
    return {name: flops / t / 1e9 for name, t in timed.items()}, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter repetitions")
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M's layer shapes")
    parser.add_argument("--shape", action="append", metavar="NxK",
                        help="a weight [N, K] instead of the model's layers (repeatable)")
    parser.add_argument("--rows", help=f"comma-separated row counts (default: {','.join(map(str, ROWS))})")
    args = parser.parse_args()
    row_counts = [int(v) for v in args.rows.split(",")] if args.rows else ROWS
    import paddle

    from fdplug.core.portable.ops import linear as portable
    from fdplug.plugins.cpu import device, isa, native_linear

    model = MODEL
    if args.smollm2:
        from levels import SMOLLM2 as model

    device.setup()
    threads = device.cpu_threads()
    rounds, budget = (4, 0.05) if args.quick else (8, 0.1)
    bf16_math = native_linear.bf16_math_available()
    dnnl = onednn()
    print(f"CPU: {isa.model_name()}, kernels built for {isa.describe()}")
    print(f"{threads} threads; GFLOP/s, medians of {rounds} interleaved timings; 'x' = packed / best other"
          + ("" if dnnl else "; no libdnnl.so.3 in paddle's wheel: oneDNN not compared"))
    rng = np.random.default_rng(0)
    layers = [tuple(int(v) for v in s.lower().split("x")) for s in args.shape] if args.shape else shapes(model)
    for n, k in layers:
        w = paddle.to_tensor(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
        wb = w.astype("bfloat16")
        packed, packed_b = native_linear.prepare(w), native_linear.prepare(wb)
        for rows in row_counts:
            x = paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32))
            xb, out = x.astype("bfloat16"), paddle.empty([rows, n], dtype="float32")
            flops = 2.0 * rows * n * k
            # B023 noqa'd below: compare() calls these lambdas in this same iteration, on this pass's x, w, ...
            calls = {"packed": lambda: native_linear.linear(x, packed, threads),  # noqa: B023
                     "inplace": lambda: native_linear.linear(x, w, threads),  # noqa: B023
                     "paddle": lambda: paddle.matmul(x, w, transpose_y=True)}  # noqa: B023
            if dnnl:
                calls["onednn"] = lambda: dnnl_call(dnnl, "dnnl_sgemm", x, w, out)  # noqa: B023
            f32, peak = compare_with_peak(calls, flops, threads, rounds, budget)
            b16 = compare({"packed": lambda: native_linear.linear(x, packed_b, threads),  # noqa: B023
                           "inplace": lambda: native_linear.linear(x, wb, threads),  # noqa: B023
                           "portable": lambda: portable(x, wb)}, flops, rounds, budget)  # noqa: B023
            others = max(v for name, v in f32.items() if name != "packed")
            line = (f"[{n:4d}, {k:4d}] {rows:4d} rows | float32 " + " ".join(f"{a} {v:6.1f}" for a, v in f32.items())
                    + f" ({f32['packed'] / others:.2f}x best, {f32['packed'] / f32['paddle']:.2f}x paddle; peak "
                    f"{peak:.0f}: packed {f32['packed'] / peak:.0%}, paddle {f32['paddle'] / peak:.0%}) | bf16 "
                    "weights " + " ".join(f"{a} {v:6.1f}" for a, v in b16.items())
                    + f" ({b16['packed'] / b16['portable']:.2f}x portable)")
            if bf16_math:
                calls = {"packed": lambda: native_linear.linear(x, packed_b, threads, bf16_math=True),  # noqa: B023
                         "inplace": lambda: native_linear.linear(x, wb, threads, bf16_math=True)}  # noqa: B023
                if dnnl:
                    calls["onednn"] = lambda: dnnl_call(dnnl, "dnnl_gemm_bf16bf16f32", xb, wb, out)  # noqa: B023
                dot = compare(calls, flops, rounds, budget)
                others = max(v for name, v in dot.items() if name != "packed")
                line += (" | bf16 math " + " ".join(f"{a} {v:6.1f}" for a, v in dot.items())
                         + f" ({dot['packed'] / others:.2f}x)")
            print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
