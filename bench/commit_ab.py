"""The engine at two commits, interleaved in one run: "no regression against commit X" measured.

    python bench/commit_ab.py --base 41cb570                 # this checkout against that commit
    python bench/commit_ab.py --base 41cb570 --pairs 4 --weights float32
    FDPLUG_CPU_ISA=avx2 python bench/commit_ab.py --base ... # both capped to x86-64-v3

Issue 33 asks that its instruction-set work cost nothing at AVX-512 "against the current commit
(interleaved in one run)": two engines of different source trees cannot share a process, so each
runs in a worker process of its own (the base commit checked out with ``git worktree`` into a
temporary folder, imported first on ``PYTHONPATH``; its kernels built into a cache of its own),
loads the model once, and then waits on its stdin; the driver asks one worker at a time for one
figure, in ABBA order, so the two never run at once and share the machine's drift. The model has
SmolLM2-135M-Instruct's sizes with random weights (``bench/levels.py``), float32 and as a bf16
checkpoint, written once by this checkout and read by both. Figures, medians: time to first token
of a fresh 1,024-token prompt, single-stream decode (tokens/s), 64 requests of 128 prompt + 64
output tokens at once (output tokens/s); each worker's prompts come from the same seeds.
"""  # noqa: E501 (printed verbatim by --help: RawDescriptionHelpFormatter)

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# The environment as the user gave it, before anything imports paddle (which sets OMP_NUM_THREADS=1
# when it is unset: a worker would inherit that, and the cpu device honours it, as one thread).
WORKER_ENV = dict(os.environ)

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIGURES = {"ttft": "TTFT 1,024 tokens (s)", "decode": "single-stream decode (tok/s)",
           "batch": "64 requests (output tok/s)"}


def worker(model_dir: str) -> None:
    """One engine of the tree on ``PYTHONPATH``; answers figure names on stdin, a line of JSON each.
    Only the public ``fdplug.LLM`` and ``fdplug.SamplingParams``: an older tree has no more in common."""
    import logging
    import time

    logging.disable(logging.INFO)
    import fdplug

    llm = fdplug.LLM(model_dir, max_model_len=2048, max_num_seqs=64, num_kv_blocks=1024)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]

    def seconds(rng, prompts: int, length: int, max_tokens: int) -> float:
        batch = [{"prompt_token_ids": rng.integers(0, vocab, size=length).tolist()} for _ in range(prompts)]
        params = fdplug.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        begin = time.perf_counter()
        llm.generate(batch, [params] * prompts, use_tqdm=False)
        return time.perf_counter() - begin

    measures = {"ttft": lambda rng: seconds(rng, 1, 1024, 1),
                "decode": lambda rng: 64 / (seconds(rng, 1, 64, 65) - seconds(rng, 1, 64, 1)),
                "batch": lambda rng: 64 * 64 / seconds(rng, 64, 128, 64)}
    linears = [layer for layer in llm.engine.runner.model.sublayers() if type(layer).__name__ == "Linear"]
    matmul = sum(getattr(layer, "prepared", False) is None for layer in linears)   # older trees: no timed choice
    selected = (f"{llm.engine.selection.summary()}; linear {llm.engine.selection.ops['linear'].name} "
                f"({matmul} of {len(linears)} layers on paddle's matmul)")
    selected += f"; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} (the cpu device's threads)"
    print(json.dumps({"ready": fdplug.__file__, "selected": selected}), flush=True)
    seeds: dict[str, int] = {}
    for line in sys.stdin:
        name = line.strip()
        seeds[name] = seeds.get(name, 0) + 1
        print(json.dumps({name: measures[name](np.random.default_rng(seeds[name]))}), flush=True)


def start_worker(tree: Path, model_dir: Path, cache: Path) -> tuple[subprocess.Popen, dict]:
    """A worker of ``tree`` with its own kernel cache (also its working directory), once its engine is loaded."""
    cache.mkdir(parents=True, exist_ok=True)
    env = dict(WORKER_ENV, PYTHONPATH=str(tree),
               FDPLUG_CACHE_DIR=str(cache))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(model_dir)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=cache)
    ready = json.loads(proc.stdout.readline() or "{}")
    if "ready" not in ready or not ready["ready"].startswith(str(tree)):
        proc.kill()
        raise SystemExit(f"the worker of {tree} did not start on its own tree: {ready}")
    return proc, ready


def ask(proc: subprocess.Popen, name: str) -> float:
    proc.stdin.write(name + "\n")
    proc.stdin.flush()
    return float(json.loads(proc.stdout.readline())[name])


def compare(trees: dict[str, Path], model_dir: Path, tmp: Path, pairs: int) -> None:
    from linear import abba  # bench/linear.py's ABBA medians (the driver's process: this checkout's fdplug)

    workers = {label: start_worker(tree, model_dir, tmp / f"cache-{label}") for label, tree in trees.items()}
    try:
        for label, (_, ready) in workers.items():
            print(f"  {label}: {ready['selected']}")
        labels = list(workers)
        for name, title in FIGURES.items():
            got: dict[str, list[float]] = {label: [] for label in labels}

            def measure(label: str, _rng, name=name, got=got) -> float:   # each figure kept for the runs' line
                got[label].append(ask(workers[label][0], name))
                return got[label][-1]

            med = abba({label: label for label in labels}, pairs, measure)
            ratio = med["base"] / med["head"] if name == "ttft" else med["head"] / med["base"]
            runs = "; ".join(f"{label} " + ", ".join(f"{v:.3g}" for v in got[label]) for label in labels)
            print(f"  {title}: head {med['head']:.3g}, base {med['base']:.3g} -> head {ratio:.2f}x ({runs})",
                  flush=True)
    finally:
        for proc, _ in workers.values():
            proc.stdin.close()
            proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="the commit to compare this checkout against")
    parser.add_argument("--pairs", type=int, default=4, help="ABBA pairs of each figure")
    parser.add_argument("--weights", default="float32,bf16", help="float32, bf16 or both")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    from fp8 import write_bf16
    from levels import SMOLLM2

    from fdplug.demo.random_model import write_random_model
    from fdplug.plugins.cpu import isa

    print(f"CPU: {isa.model_name()}, {isa.describe()}; head {ROOT}, base {args.base}")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tmp / "base"), args.base],
                       check=True, capture_output=True)
        try:
            float_dir = tmp / "float32"
            float_dir.mkdir()
            write_random_model(float_dir, **SMOLLM2)
            models = {"float32": float_dir, "bf16": write_bf16(float_dir, tmp / "bf16")}
            for weights in args.weights.split(","):
                print(f"{weights} weights:")
                compare({"head": ROOT, "base": tmp / "base"}, models[weights], tmp, args.pairs)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / "base")], check=False)


if __name__ == "__main__":
    sys.exit(main())
