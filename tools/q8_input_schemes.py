"""Perplexity of SmolLM2-135M-Instruct (Q4_1 GGUF) with the GGUF linears' inputs rounded by a scheme.

    python tools/q8_input_schemes.py float run4 run32 shift8
    python tools/q8_input_schemes.py --gguf OTHER.gguf run4 shift8

Why: q8 math (``cpu_native_gguf_q8_linear``) quantizes each linear's input to 8-bit integers, and
how finely it scales them decides both its accuracy and how much float work its tiles do (see
docs/cpu-kernels.md, "Where q8 math stops at AVX2"). This emulates a scheme on the portable op
(``paddle_gguf_linear`` with its input replaced by the rounded values; everything else as selected)
and prints the perplexity of tests/test_smollm2.py's fixed text against the fixture's transformers
reference, and the chat fixture's greedy answer. It measures the rounding, not a kernel's speed.

Schemes:
  ``float``    no rounding (the portable op itself)
  ``runN``     a scale per run of N values, ``d = amax / 127``, ``q = rint(x / d)``: run4 is q8 math's
               definition (`fdplug.plugin_api.gguf_formats.q8_inputs`), run32 llama.cpp's q8_0
  ``shiftT``   a scale ``D = amax / 127`` per 32 values and, per run of 4, ``D * 2^-t`` with ``t`` the
               largest in 0..T that keeps the run's ``|q| <= 127``: integer sums a kernel can add
               across a piece of 32 after a power-of-two multiplier per run
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
F32 = np.float32


def runs(x: np.ndarray, n: int) -> np.ndarray:
    r = x.reshape(*x.shape[:-1], -1, n)
    d = np.max(np.abs(r), -1, keepdims=True) / F32(127)
    inverse = np.divide(F32(1), d, out=np.zeros_like(d), where=d != 0)
    return (np.rint(r * inverse) * d).reshape(x.shape)


def shifted(x: np.ndarray, most: int) -> np.ndarray:
    b = x.reshape(*x.shape[:-1], -1, 8, 4)
    run_max = np.max(np.abs(b), -1, keepdims=True)
    piece_max = np.max(run_max, -2, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.floor(np.log2(piece_max / run_max))
    t = np.where(run_max == 0, most, np.clip(np.nan_to_num(t, nan=most, posinf=most), 0, most))
    scale = (piece_max / F32(127) * np.exp2(-t)).astype(F32)
    inverse = np.divide(F32(1), scale, out=np.zeros_like(scale), where=scale != 0)
    q = np.clip(np.rint(b * inverse), -127, 127)
    return (q * scale).reshape(x.shape)


def rounder(scheme: str):
    if scheme == "float":
        return lambda x: x
    if scheme.startswith("run"):
        return lambda x: runs(x, int(scheme[3:]))
    if scheme.startswith("shift"):
        return lambda x: shifted(x, int(scheme[5:]))
    raise SystemExit(f"unknown scheme {scheme!r}: float, runN or shiftT")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("schemes", nargs="+")
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the cached SmolLM2 Q4_1, --model smollm2)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import paddle

    import fdplug.core.portable.ops as ops
    from fdplug import LLM, SamplingParams
    from fdplug.demo.pypi_models import resolve_model
    from tests.reference import mean_nll

    golden = json.loads((ROOT / "tests/fixtures/gguf/smollm2_q4_1.json").read_text())
    exact, current = ops.gguf_linear, {"round": None}

    def rounded(x, weight, qtype, k):
        values = current["round"](x.numpy().astype(np.float32)).astype(np.float32)
        return exact(paddle.to_tensor(values), weight, qtype, k)

    ops.gguf_linear = rounded   # before the LLM: the op's factory looks it up when the engine starts
    llm = LLM(args.gguf or resolve_model("smollm2"), max_model_len=1024,
              op_kernels={"gguf_linear": "paddle_gguf_linear", "decoder_stack": "paddle_layer_by_layer"})
    ids, chat = golden["perplexity"]["ids"], golden["chat"][0]
    for scheme in args.schemes:
        current["round"] = rounder(scheme)
        ppl = math.exp(mean_nll(llm, ids))
        params = SamplingParams(max_tokens=len(chat["tokens"]), temperature=0, ignore_eos=True)
        answer = llm.generate({"prompt_token_ids": chat["ids"]}, params)[0].outputs[0]
        print(f"{scheme:8s} perplexity {ppl:.5f} ({100 * (ppl / golden['perplexity']['ppl'] - 1):+.3f}% "
              f"against transformers') | chat: {answer.text!r}"
              f"{' (the fixture answer)' if list(answer.token_ids) == chat['tokens'] else ''}", flush=True)


if __name__ == "__main__":
    main()
