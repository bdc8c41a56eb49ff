"""Two builds of the cpu kernel library against each other on the packed linear, in one process.

    python bench/linear_ab.py --a OLD.so --b NEW.so                          # float32, SmolLM2's shapes
    python bench/linear_ab.py --a OLD.so --b NEW.so --kind bf16-math --rows 16,256,2048   # AMX / vdpbf16ps
    FDPLUG_CPU_ISA=avx2 python bench/linear_ab.py --a OLD.so --b NEW.so       # two x86-64-v3 builds

Why: kernel_ab.py's reason, for the float weights: a change to the packed linear's tiles, its row
blocks or its copies is worth a few percent, and this machine drifts by more than that between two
runs. Both libraries are loaded into one process (ctypes) and their ``fdplug_linear_packed`` calls
alternate (A B B A ..., `gemm.median_seconds`) on the same inputs and the same packed weights
(`native_linear.prepare`, in the layout of this checkout's build, which both builds must read: the
same level, `fdplug_linear_packed_panel`). Each pair's outputs are compared first: a change that
should keep the bits is checked too. ``--weights`` copies of each layer are cycled, so that the
weights come from memory as in a model. ``--kind``: float32 weights, bf16 weights in float32 math
(widened), or bf16 math (x rounded to bf16: AMX tiles where the build has them, else vdpbf16ps).
Build a library with this checkout's flags (`fdplug.plugins.cpu.kernel_build`), or as kernel_ab.py says.
"""

from __future__ import annotations

import argparse
import ctypes
import sys

import numpy as np
from gemm import add_build_ab_arguments, cycled, linear_builds_line, start_build_ab  # (ABBA..., medians)

SMOLLM2_SHAPES = "960x576,576x576,3072x576,576x1536"   # [N, K]: qkv, o, gate+up, down
KINDS = {"float32": 0, "bf16": 1, "bf16-math": 2}      # fdplug_linear_packed's kind


def library(path: str):
    """The linear call of the library at path (refused where its packed layout is not this build's)."""
    from fdplug.plugins.cpu import kernels, native_linear

    lib = ctypes.CDLL(path)
    linear = lib.fdplug_linear_packed
    linear.restype, linear.argtypes = kernels.SIGNATURES["fdplug_linear_packed"]
    if lib.fdplug_linear_packed_panel() != native_linear.panel_width():
        raise SystemExit(f"{path} reads panels of {lib.fdplug_linear_packed_panel()} columns, this build's "
                         f"{native_linear.panel_width()}: build both for the same level (FDPLUG_CPU_ISA)")
    return linear


def line(args, libs: dict, n: int, k: int, rows: int) -> str:
    import paddle

    from fdplug.plugins.cpu import native_linear

    rng = np.random.default_rng(0)
    dtype = "float32" if args.kind == "float32" else "bfloat16"
    weights = [native_linear.prepare(paddle.to_tensor(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
                                     .astype(dtype)) for _ in range(args.weights)]
    x = paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32))
    out = paddle.empty([rows, n], dtype="float32")
    kind = KINDS[args.kind]

    def status_call(name: str):
        linear, weight = libs[name], cycled(weights)   # each call the next copy of the layer
        return lambda: linear(x.data_ptr(), weight().data.data_ptr(), kind, None, out.data_ptr(), rows, n, k,
                              args.threads)

    label = f"{args.kind:9s} [{n:5d}, {k:4d}] {rows:5d} rows"
    return linear_builds_line(status_call, out, label, 2.0 * n * k * rows, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_build_ab_arguments(parser)   # --a, --b, --rounds, --budget, --threads
    parser.add_argument("--kind", choices=sorted(KINDS), default="float32")
    parser.add_argument("--rows", default="1,64,256,1024", help="comma-separated row counts")
    parser.add_argument("--shapes", default=SMOLLM2_SHAPES, help="comma-separated NxK (weights [N, K])")
    parser.add_argument("--weights", type=int, default=4, help="copies of each layer, cycled (from memory)")
    args = parser.parse_args()
    start_build_ab(args)
    libs = {"A": library(args.a), "B": library(args.b)}
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.lower().split("x"))
        for rows in (int(v) for v in args.rows.split(",")):
            print(line(args, libs, n, k, rows), flush=True)


if __name__ == "__main__":
    sys.exit(main())
