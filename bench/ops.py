"""The op kernels besides the linears against the portable ops: RMSNorm, the residual add + RMSNorm,
RoPE, SwiGLU, argmax, and the attention and MoE backends against the reference backends.

    python bench/ops.py                     # SmolLM2-135M's sizes, 1 to 1,024 tokens
    python bench/ops.py --quick             # fewer, shorter repetitions
    FDPLUG_CPU_ISA=avx2 python bench/ops.py # the kernels built for x86-64-v3

Issue 33 asks every cpu kernel to be at least as fast as the portable op on every shape the engine
gives it, at every instruction-set level; the linears have `bench/gemm.py` and the startup timing
(`fdplug.core.worker.op_timing`), these ops had no figure of their own. Each op runs as the engine
calls it: the kernel the selection chose for the op (``spec.factory(EngineConfig())``, threads as
the engine's) against `fdplug.core.portable.ops` (paddle's ops), on the shapes of a SmolLM2-135M
step (hidden 576, 9 query and 3 KV heads of 64, intermediate 1,536, vocabulary 49,152; the
arguments the startup timing builds, `row_op_timing.RowCase`: RoPE on the q and k heads together,
as the decoder calls it, where this bench timed them apart before 2026-11-30) at 1, 32, 256 and 1,024
tokens (argmax: the sampled rows, 1, 32 and 64); attention: one layer's ``forward``
(the KV write, then attention; ``prepare`` is once a step, outside the timing) of the selected
backend against ``reference`` (paddle's matmuls and softmax), decode with 1, 16 and 64 sequences of
512 keys each, prefill of one fresh 256- and 1,024-token prompt; MoE: one layer's routed experts
(``forward``) of the selected backend against ``reference`` on `bench/moe.py`'s model (32 experts of
width 384, top-4 of random distinct experts, hidden 512) at 1, 32 and 256 tokens. Microseconds a call, the two
alternated (ABAB...), medians; 'x' = portable time / kernel time. The first line names the CPU and
the level the kernels were built for.
"""  # noqa: E501 (printed verbatim by --help: RawDescriptionHelpFormatter)

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import numpy as np
from gemm import median_seconds  # the calls alternated, median seconds of each

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 576, 9, 3, 64, 1536, 49152
MOE_HIDDEN, MOE_INTER, EXPERTS, TOP_K = 512, 384, 32, 4   # bench/moe.py's model
TOKENS = (1, 32, 256, 1024)
SAMPLED = (1, 32, 64)
SMOLLM2 = SimpleNamespace(hidden_size=HIDDEN, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                          intermediate_size=INTER, vocab_size=VOCAB, num_layers=30, moe=None, qk_norm=False)
"""The `ModelConfig` fields `row_op_timing.row_cases` reads, SmolLM2-135M's."""
BENCH_MOE = SimpleNamespace(hidden_size=MOE_HIDDEN, moe=SimpleNamespace(
    num_experts=EXPERTS, intermediate_size=MOE_INTER, routing=SimpleNamespace(top_k=TOP_K)))
"""The fields `expert_samples.experts_call` reads, bench/moe.py's model."""


def cases(rows: int, rng: np.random.Generator) -> dict[str, tuple]:
    """Each row op's arguments for ``rows`` tokens of a SmolLM2 step, as the startup timing builds
    them (`row_op_timing.RowCase`: float32; RoPE on the q and k heads together, as the decoder calls
    it; argmax on its own, over the sampled rows)."""
    from fdplug.core.worker.row_op_timing import row_cases

    ops = ("rms_norm", "add_rms_norm", "rope", "swiglu")
    return {case.op: case.arguments(rows, rng) for case in row_cases(SMOLLM2, ops)}


def attention_call(backend, meta, num_blocks: int, rng: np.random.Generator):
    """One layer's ``forward`` on caches of random keys and values (float32), as a call without
    arguments: the startup timing's (`backend_timing.attention_call`) at SmolLM2's heads."""
    from fdplug.core.config import EngineConfig
    from fdplug.core.worker.backend_timing import attention_call as call

    return call(backend, SMOLLM2, EngineConfig(dtype="float32"), meta, num_blocks, rng)


def moe_call(backend, tokens: int, rng: np.random.Generator):
    """One MoE layer's routed experts (random float32 weights, random top-4 routing) as a call without
    arguments: the startup timing's (`expert_samples.experts_call`) on bench/moe.py's model."""
    from fdplug.core.worker.expert_samples import ExpertFormat, experts_call

    return experts_call(backend, BENCH_MOE, ExpertFormat(), "float32", 1 << 40, rng)(tokens)


def time_pair(kernel, portable, args: tuple, rounds: int, budget: float) -> tuple[float, float]:
    """Median seconds a call of each (`median_seconds`)."""
    t = median_seconds({"kernel": lambda: kernel(*args), "portable": lambda: portable(*args)}, rounds, budget)
    return t["kernel"], t["portable"]


def report(what: str, chosen: str, times: tuple[float, float], against: str, slower: list[str]) -> None:
    """One line: the chosen kernel's and the portable op's microseconds a call and their ratio; a
    kernel slower than the op is added to ``slower``."""
    kernel_s, portable_s = times
    if kernel_s > portable_s:
        slower.append(" ".join(what.split()))
    print(f"{what:27} | {chosen:24} {kernel_s * 1e6:9.1f} us | {against} {portable_s * 1e6:9.1f} us | "
          f"{portable_s / kernel_s:6.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter repetitions")
    args = parser.parse_args()

    import paddle

    from fdplug import select_components
    from fdplug.core.config import EngineConfig
    from fdplug.core.portable import ops as portable_ops
    from fdplug.core.worker.backend_timing import step_metadata
    from fdplug.plugins.cpu import device, isa

    paddle.set_device("cpu")
    selection = select_components("cpu")
    config = EngineConfig()
    rounds, budget = (3, 0.02) if args.quick else (7, 0.05)
    print(f"CPU: {isa.model_name()}, kernels built for {isa.describe()}")
    print(f"{device.cpu_threads()} threads; microseconds a call, medians of {rounds} interleaved timings; "
          "'x' = portable time / kernel time")
    rng = np.random.default_rng(0)
    slower: list[str] = []
    for rows in TOKENS:
        for name, call_args in cases(rows, rng).items():
            spec = selection.ops[name.split()[0]]
            times = time_pair(spec.factory(config), getattr(portable_ops, spec.op), call_args, rounds, budget)
            report(f"{name:13} {rows:5} tokens", spec.name, times, "portable", slower)
    argmax = selection.ops["argmax"]
    for rows in SAMPLED:
        logits = paddle.to_tensor(rng.standard_normal((rows, VOCAB)).astype(np.float32))
        times = time_pair(argmax.factory(config), portable_ops.argmax, (logits,), rounds, budget)
        report(f"{'argmax':13} {rows:5} rows", argmax.name, times, "portable", slower)
    chosen = selection.attention
    backend = chosen.factory(config)
    reference = select_components("cpu", attention="reference").attention.factory(config)
    for label, seqs, query_len, context in [("decode", 1, 1, 512), ("decode", 16, 1, 512), ("decode", 64, 1, 512),
                                            ("prefill", 1, 256, 256), ("prefill", 1, 1024, 1024)]:
        meta, num_blocks = step_metadata(seqs, query_len, context, config.block_size)
        times = time_pair(attention_call(backend, meta, num_blocks, rng),
                          attention_call(reference, meta, num_blocks, rng), (), rounds, budget)
        what = f"{seqs} x {context} keys" if label == "decode" else f"{query_len} tokens"
        report(f"{label + ' attn':13} {what:>13}", chosen.name, times, "reference", slower)
    moe = selection.moe
    moe_backend, moe_reference = moe.factory(config), select_components("cpu", moe="reference").moe.factory(config)
    for tokens in (1, 32, 256):
        times = time_pair(moe_call(moe_backend, tokens, rng), moe_call(moe_reference, tokens, rng), (), rounds,
                          budget)
        report(f"{'MoE experts':13} {tokens:5} tokens", moe.name, times, "reference", slower)
    print("kernel slower than the portable op: " + (", ".join(slower) if slower else "none"))


if __name__ == "__main__":
    sys.exit(main())
