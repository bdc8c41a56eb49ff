"""GGUF linear layers: the cpu kernel (``cpu_native_gguf_linear``) against the portable op.

    python bench/gguf_linear.py                        # Q4_1, Q8_0, Q6_K; 1, 8, 64, 256 rows; the lm_head
    python bench/gguf_linear.py --quick                # fewer, shorter repetitions
    python bench/gguf_linear.py --types Q4_K,Q5_0 --rows 1,16
    FDPLUG_CPU_ISA=avx2 python bench/gguf_linear.py    # the kernels built for x86-64-v3 (AVX2 tiles)

Why: the portable op (`fdplug.core.portable.ops.gguf_linear`) dequantizes the whole layer with
paddle's ops on every call, then runs paddle's matmul; the kernel widens each block in registers
(csrc/gguf_linear.c). Per weight type, layer ``[N, K]`` and row count: microseconds a call of
each, GFLOP/s (2 N K rows / time) and the ratio; where the op takes another route (AVX2 tiles, more
than 16 rows: the layer widened in C, then paddle's matmul) that route too, as ``widen+matmul``. The 32-weight types run SmolLM2-135M's shapes
(576x576, 1536x576, 576x1536); the K-quants, whose rows are 256-weight blocks, 512x512, 1536x512
and 512x1536; the tied lm_head (49152x576, Q8_0) at one row. The variants alternate (ABAB...) and
the median of each is kept: this machine is shared and drifts, so only the ratios within a line
mean much. Where the build has AVX512-BF16, the bf16-math tiles (``cpu_native_gguf_bf16_linear``)
too, as ``bf16 math``, with their speed against the float32 kernel; where it has AVX2, the q8-math
tiles (``cpu_native_gguf_q8_linear``) as ``q8 math``. The first line names the CPU and the level the kernels were built for.
"""  # noqa: E501 (printed verbatim by --help: RawDescriptionHelpFormatter)

from __future__ import annotations

import argparse
import sys

import numpy as np
from gemm import median_seconds  # the calls alternated, median seconds of each

ROWS = (1, 8, 64, 256)
TYPES = ("Q4_1", "Q8_0", "Q6_K")
SHAPES = {32: [(576, 576), (1536, 576), (576, 1536)], 256: [(512, 512), (1536, 512), (512, 1536)]}
LM_HEAD = ("Q8_0", 49152, 576, 1)


def blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``[n, row_bytes]`` uint8 GGML blocks: gguf's quantizer where it has one, else random bytes
    with finite float16 scales (the K-quants: gguf quantizes none of them)."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    try:
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, kind)
    except NotImplementedError:
        block, nbytes = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (n, k // block, nbytes), dtype=np.uint8)
        scales = rng.uniform(-1e-3, 1e-3, (n, k // block, 2)).astype(np.float16).view(np.uint8)
        if qtype == "Q6_K":
            raw[..., 208:210] = scales[..., :2]
        else:
            raw[..., 0:4] = scales
        return raw.reshape(n, -1)


def line(qtype: str, n: int, k: int, rows: int, rounds: int, budget: float, threads: int,
         rng: np.random.Generator) -> str:
    import paddle

    from fdplug.core.portable.ops import gguf_linear as portable
    from fdplug.plugins.cpu import native_gguf, native_gguf_packed

    w = paddle.to_tensor(blocks(qtype, n, k, rng))
    x = paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32))
    calls = {"kernel": lambda: native_gguf.gguf_linear(x, w, qtype, k, threads),
             "portable": lambda: portable(x, w, qtype, k)}
    if native_gguf.bf16_math_available():   # cpu_native_gguf_bf16_linear: the same tiles in bf16 math
        calls["bf16 math"] = lambda: native_gguf.gguf_linear(x, w, qtype, k, threads, bf16_math=True)
    if native_gguf.q8_math_available():     # cpu_native_gguf_q8_linear: inputs quantized, integer sums
        calls["q8 math"] = lambda: native_gguf.gguf_linear(x, w, qtype, k, threads, q8_math=True)
    packed = native_gguf_packed.prepare(w, qtype)
    if packed is not None:                  # cpu_native_gguf_packed_linear: repacked at load, runs of 16
        calls["packed"] = lambda: native_gguf_packed.gguf_linear(x, packed, qtype, k, threads)
    if rows > 8:   # the route the kernel declined for its batch invariance: widened in C, paddle's matmul
        calls["widen+matmul"] = lambda: paddle.matmul(x, native_gguf.dequantize(w, qtype, k, threads),
                                                      transpose_y=True)
    t = median_seconds(calls, rounds, budget)
    best = min(("bf16 math", "q8 math", "kernel"), key=lambda name: t.get(name, float("inf")))
    flops = 2.0 * n * k * rows
    return (f"{qtype:5s} [{n:5d}, {k:4d}] {rows:4d} rows | "
            + " | ".join(f"{name} {v * 1e6:9.1f} us {flops / v / 1e9:6.1f} GFLOP/s" for name, v in t.items())
            + f" | kernel {t['portable'] / t['kernel']:6.1f}x portable"
            + (f", bf16 math {t['kernel'] / t['bf16 math']:5.2f}x kernel" if "bf16 math" in t else "")
            + (f", q8 math {t['kernel'] / t['q8 math']:5.2f}x kernel" if "q8 math" in t else "")
            + (f", packed {t[best] / t['packed']:5.2f}x {best}" if "packed" in t else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter repetitions")
    parser.add_argument("--types", help=f"comma-separated GGML types (default: {','.join(TYPES)})")
    parser.add_argument("--rows", help=f"comma-separated row counts (default: {','.join(map(str, ROWS))})")
    parser.add_argument("--no-lm-head", action="store_true", help="skip the 49152x576 Q8_0 lm_head")
    parser.add_argument("--threads", type=int, default=None,
                        help="the kernels' threads (default: the cpu device's; paddle keeps its own)")
    args = parser.parse_args()
    types = args.types.upper().split(",") if args.types else TYPES
    row_counts = [int(v) for v in args.rows.split(",")] if args.rows else ROWS
    from fdplug.plugin_api.gguf_formats import format_of
    from fdplug.plugins.cpu import device, isa

    device.setup()
    threads = args.threads or device.cpu_threads()
    rounds, budget = (3, 0.03) if args.quick else (7, 0.05)
    print(f"CPU: {isa.model_name()}, kernels built for {isa.describe()}")
    print(f"{threads} threads; medians of {rounds} interleaved timings; 'x' = portable time / kernel time")
    rng = np.random.default_rng(0)
    for qtype in types:
        for n, k in SHAPES[format_of(qtype).block]:
            for rows in row_counts:
                print(line(qtype, n, k, rows, rounds, budget, threads, rng), flush=True)
    if not args.no_lm_head:
        qtype, n, k, rows = LM_HEAD
        print(line(qtype, n, k, rows, rounds, budget, threads, rng), flush=True)


if __name__ == "__main__":
    sys.exit(main())
