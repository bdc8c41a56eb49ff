"""What structured outputs cost per step: 64 decoding requests, none, one or all of them constrained.

    OPENBLAS_NUM_THREADS=1 python bench/structured.py                # the SmolLM2 GGUF (49,152 tokens)
    python bench/structured.py --model DIR --rounds 5

Each round runs the three batches back to back in a rotating order (interleaved, so the machine's
drift hits them alike), each 64 requests of ``--tokens`` tokens (``ignore_eos``: every request runs
every step), and reports the median milliseconds per step and the ratio to the unconstrained batch.
The constraint is a JSON string (``{"type": "string"}``): it never completes within the budget, so
its mask is computed and applied at every step. The masks are computed on a worker thread beside
the forward pass (`fdplug.core.portable.grammar_masks`); what is left on the step is waiting for them
and applying them to the constrained rows of the logits.
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import time

import fdplug
from fdplug.plugin_api.sampling_params import SamplingParams

CONSTRAINT = {"json": {"type": "string"}}


def batch(llm: fdplug.LLM, constrained: int, tokens: int, seed: int) -> float:
    """Milliseconds per step of 64 requests decoding ``tokens`` tokens, ``constrained`` of them held."""
    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=tokens, ignore_eos=True,
                             structured_outputs=CONSTRAINT if i < constrained else None) for i in range(64)]
    prompts = [f"Write a name for thing number {seed + i}:" for i in range(64)]
    steps_before = llm.engine.profiler.steps
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return (time.perf_counter() - start) * 1e3 / (llm.engine.profiler.steps - steps_before)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a model directory, a GGUF file, or a name (smollm2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    logging.disable(logging.INFO)
    llm = fdplug.LLM(args.model, max_model_len=256, max_num_seqs=64)
    cases = {"unconstrained": 0, "1 of 64 constrained": 1, "64 of 64 constrained": 64}
    for n in cases.values():       # warm-up: the grammar compiler, the kernels, the allocator
        batch(llm, n, 8, seed=10_000)
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            times[name].append(batch(llm, cases[name], args.tokens, seed=100 * r))
    base = statistics.median(times["unconstrained"])
    print(f"{cpu_model()}; model {args.model}, vocabulary "
          f"{llm.model_config.vocab_size}; 64 requests x {args.tokens} tokens, {args.rounds} interleaved rounds")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:22s} {median:7.2f} ms/step  ({median / base:.3f}x)  runs: "
              + " ".join(f"{v:.1f}" for v in values))


if __name__ == "__main__":
    main()
