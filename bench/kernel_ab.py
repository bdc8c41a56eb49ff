"""Two builds of the cpu kernel library against each other on the packed GGUF tiles, in one process.

    python bench/kernel_ab.py --a OLD.so --b NEW.so                     # SmolLM2's shapes, 1/64/1,024 rows
    python bench/kernel_ab.py --a OLD.so --b NEW.so --types Q6_K --rows 1 --shapes 576x1536
    python -c "from fdplug.plugins.cpu import kernels; print(kernels.load()._name)"   # this checkout's build

Why: a kernel change is worth a few percent, and this machine drifts by more than that between two
runs of a process (AMD EPYC, avx2-or-less: +-15-30%). Here both libraries are loaded into one process
(ctypes), each packs the same GGUF blocks with its own ``fdplug_gguf_pack`` (the packed layout is a
build's own: its bit planes, its K-quant headers), and their ``fdplug_gguf_linear_packed`` calls
alternate (A B B A ..., `gemm.median_seconds`) on the same inputs; the median time of each is kept and B's time over A's
printed (below 1: B is faster). Each pair's outputs are compared first: two builds that differ in
their bits are refused, so a layout or a schedule change that should keep the bits is checked too.
``--weights`` copies of each layer are cycled, so that (as in a model) the weights come from memory,
not from the cache a previous call left them in.
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import numpy as np
from gemm import add_build_ab_arguments, cycled, linear_builds_line, start_build_ab  # (ABBA..., medians)
from gguf_linear import blocks  # the GGML blocks of a type (gguf's quantizer, or random bytes)

SHAPES = {"Q4_K": "576x1536,1536x512", "Q5_K": "576x1536", "Q6_K": "576x1536,1536x512"}
DEFAULT_SHAPES = "1536x576,576x1536"   # SmolLM2's MLP: gate/up, down (the 32-weight types)


def library(path: str, qtype_id: int, raw: list, n: int, k: int):
    """(the linear call, its packed copies of raw) for the library at path"""
    import paddle

    from fdplug.plugins.cpu import kernels

    lib = ctypes.CDLL(path)
    linear, pack = lib.fdplug_gguf_linear_packed, lib.fdplug_gguf_pack
    linear.restype, linear.argtypes = kernels.SIGNATURES["fdplug_gguf_linear_packed"]
    pack.restype, pack.argtypes = kernels.SIGNATURES["fdplug_gguf_pack"]
    packed = []
    for w in raw:
        out = paddle.empty(w.shape, dtype="uint8")
        if pack(w.data_ptr(), out.data_ptr(), n, k, qtype_id) != 0:
            raise SystemExit(f"{path} does not pack {n}x{k} of this type")
        packed.append(out)
    return linear, packed


def line(args, qtype: str, n: int, k: int, rows: int) -> str:
    import paddle

    from fdplug.plugins.cpu import native_gguf

    rng = np.random.default_rng(0)
    raw = [paddle.to_tensor(blocks(qtype, n, k, rng)) for _ in range(args.weights)]
    x = paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32))
    out = paddle.empty([rows, n], dtype="float32")
    qid = native_gguf._type_id(qtype)
    libs = {"A": library(args.a, qid, raw, n, k), "B": library(args.b, qid, raw, n, k)}

    def status_call(name: str):
        linear, packed = libs[name][0], cycled(libs[name][1])   # each call the next copy of the layer
        return lambda: linear(x.data_ptr(), packed().data_ptr(), out.data_ptr(), rows, n, k, qid, 1, args.threads)

    return linear_builds_line(status_call, out, f"{qtype:5s} [{n:5d}, {k:4d}] {rows:5d} rows", 2.0 * n * k * rows, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_build_ab_arguments(parser)   # --a, --b, --rounds, --budget, --threads
    parser.add_argument("--types", default="Q4_1,Q5_0,Q8_0,Q4_K,Q6_K", help="comma-separated GGML types")
    parser.add_argument("--rows", default="1,64,1024", help="comma-separated row counts")
    parser.add_argument("--shapes", help=f"comma-separated NxK (default: {DEFAULT_SHAPES}; K-quants {SHAPES})")
    parser.add_argument("--weights", type=int, default=32, help="copies of each layer, cycled (from memory)")
    args = parser.parse_args()
    start_build_ab(args)
    for qtype in args.types.upper().split(","):
        for shape in (args.shapes or SHAPES.get(qtype, DEFAULT_SHAPES)).split(","):
            n, k = (int(v) for v in shape.lower().split("x"))
            for rows in (int(v) for v in args.rows.split(",")):
                print(line(args, qtype, n, k, rows), flush=True)


if __name__ == "__main__":
    sys.exit(main())
