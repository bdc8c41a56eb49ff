"""FP8 block weights on the portable path: memory, load time and step time against the float model.

    python bench/fp8.py            # the 151M Qwen3-MoE of bench/moe.py
    python bench/fp8.py --quick    # fewer pairs

One random-weight Qwen3-MoE (bench/moe.py's: 6 layers x 32 experts, top-4, hidden 512) is written
three ways: float32, bfloat16 (the same weights rounded), and FP8 128x128 blocks
(`fdplug.core.quant.checkpoint`, what ``tools/make_fp8_checkpoint.py`` writes). Figures, all
measured in this run:

1. weight memory: bytes of the checkpoint files, and bytes the loaded model holds (parameters plus
   the experts in their backend's layout). On the cpu device bf16 weights are cast to float32 at
   load, so bf16's loaded figure is what a bf16 device would hold (2 bytes a parameter);
2. load time: `load_model` of the FP8 checkpoint vs the float32 one (and online quantization of the
   float32 one), interleaved in rounds, medians;
3. step time: the forward of a decode step at 1 and 16 running requests, FP8 vs float32 both with
   the cpu plugin's kernels (FP8: experts and linears read in place by the compiled FP8 linear;
   float32: the packed MoE kernel), and FP8 on the portable path (each expert and layer dequantized
   when it runs), in ABBA blocks, medians;
4. the same for a dense model (bench/throughput.py's 54M Qwen2, quantized online): FP8 linears
   through the cpu plugin's compiled kernel (weights read in place, one byte each), through the
   portable dequantize-and-matmul, and float32.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from moe import MODEL, _prompt, make_model  # bench/moe.py: the same model
from throughput import make_model as make_dense_model
from throughput import params


def write_bf16(src: Path, dst: Path) -> Path:
    """``src`` with every tensor stored as bfloat16 (config dtype bfloat16)."""
    import json
    import shutil

    from safetensors.paddle import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    tensors = {k: v.astype("bfloat16") for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16"}))
    return dst


def loaded_bytes(model_dir: Path) -> int:
    from fdplug.core.frontend.llm import LLM

    return LLM(str(model_dir), max_model_len=256, num_kv_blocks=32).engine.runner.model_bytes


def load_seconds(model_dir: Path, quantization: str | None = None) -> float:
    from fdplug.core.model.loader import load_model
    from fdplug.core.portable.attention import ReferenceAttention
    from fdplug.core.portable.moe import ReferenceMoE

    start = time.perf_counter()
    load_model(model_dir, ReferenceAttention(), show_progress=False, moe_backend=ReferenceMoE(),
               quantization=quantization)
    return time.perf_counter() - start


def decode_forward(llms: dict, running: int, pairs: int, steps: int = 4) -> dict[str, float]:
    """Median forward seconds of a decode step with ``running`` requests, engines in ABBA blocks."""
    rng = np.random.default_rng(running)
    prompts = [rng.integers(0, MODEL["vocab_size"], size=32).tolist() for _ in range(running)]
    for llm in llms.values():
        for p in prompts:
            llm._submit(_prompt(p), params(pairs * steps + 8))
        for _ in range(4):   # past the prefill
            llm._step()
    per_step: dict[str, list[float]] = {name: [] for name in llms}
    names = list(llms)
    for i in range(pairs):
        for name in (names if i % 2 == 0 else names[::-1]):
            llm = llms[name]
            before = llm.engine.profiler.snapshot()["forward"]
            for _ in range(steps):
                llm._step()
            per_step[name].append((llm.engine.profiler.snapshot()["forward"] - before) / steps)
    for llm in llms.values():    # finish what is left so the next round starts empty
        while llm.engine.has_unfinished_requests():
            llm._step()
    return {name: statistics.median(v) for name, v in per_step.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 load rounds and 3 step pairs")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    from fdplug.core.frontend.llm import LLM
    from fdplug.core.quant.checkpoint import quantize_checkpoint

    rounds = 3 if args.quick else 7
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dirs = {"float32": make_model(root)}
        dirs["bfloat16"] = write_bf16(dirs["float32"], root / "bf16")
        quantize_checkpoint(dirs["float32"], root / "fp8", block=(128, 128))
        dirs["fp8"] = root / "fp8"
        print(f"model: bench/moe.py's random Qwen3-MoE ({MODEL['num_hidden_layers']} layers x {MODEL['num_experts']} "
              f"experts, hidden {MODEL['hidden_size']}); FP8: 128x128 blocks, embeddings/norms/routers/lm_head float")

        disk = {name: (d / "model.safetensors").stat().st_size for name, d in dirs.items()}
        memory = {"float32": loaded_bytes(dirs["float32"]), "fp8": loaded_bytes(dirs["fp8"])}
        memory["bfloat16"] = memory["float32"] // 2
        embeddings = 2 * MODEL["vocab_size"] * MODEL["hidden_size"] * 4   # embed_tokens + lm_head, float32
        print("1. weights (MB)   checkpoint   loaded")
        for name in ("float32", "bfloat16", "fp8"):
            note = " (on a bf16 device)" if name == "bfloat16" else ""
            print(f"   {name:9s} {disk[name] / 1e6:10.1f} {memory[name] / 1e6:9.1f}{note}")
        rest = {name: memory[name] - embeddings // (2 if name == "bfloat16" else 1) for name in memory}
        print(f"   loaded ratios: fp32/fp8 {memory['float32'] / memory['fp8']:.2f}x, bf16/fp8 "
              f"{memory['bfloat16'] / memory['fp8']:.2f}x; without the embeddings and lm_head (float in all three, "
              f"{embeddings / 1e6:.0f} MB in fp32): {rest['float32'] / rest['fp8']:.2f}x and "
              f"{rest['bfloat16'] / rest['fp8']:.2f}x")

        loads: dict[str, list[float]] = {"float32": [], "fp8": [], "online": []}
        for r in range(rounds):
            order = ["float32", "fp8", "online"] if r % 2 == 0 else ["online", "fp8", "float32"]
            for name in order:
                d, q = (dirs["float32"], "fp8") if name == "online" else (dirs[name], None)
                loads[name].append(load_seconds(d, q))
        med = {k: statistics.median(v) for k, v in loads.items()}
        print(f"2. load_model, median of {rounds} rounds: float32 {med['float32']:.2f} s, fp8 {med['fp8']:.2f} s "
              f"(ratio {med['fp8'] / med['float32']:.2f}), float32 quantized online {med['online']:.2f} s "
              f"(ratio {med['online'] / med['float32']:.2f})")

        engine_args = dict(max_model_len=512, max_num_seqs=16, num_kv_blocks=256)
        llms = {"fp8": LLM(str(dirs["fp8"]), moe_backend="cpu_native", **engine_args),
                "float32": LLM(str(dirs["float32"]), moe_backend="cpu_native", **engine_args),
                "fp8_portable": LLM(str(dirs["fp8"]), moe_backend="reference",
                                    op_kernels={"fp8_linear": "paddle_fp8_linear"}, **engine_args)}
        for running in (1, 16):
            t = decode_forward(llms, running, pairs=3 if args.quick else 8)
            print(f"3. decode step forward, {running:2d} running: fp8 (cpu_native) {t['fp8'] * 1e3:.1f} ms, float32 "
                  f"(cpu_native) {t['float32'] * 1e3:.1f} ms, ratio {t['fp8'] / t['float32']:.2f}; fp8 portable "
                  f"(reference MoE, paddle_fp8_linear) {t['fp8_portable'] * 1e3:.1f} ms")
        del llms

        dense = make_dense_model(root)
        llms = {"fp8": LLM(str(dense), quantization="fp8", **engine_args),
                "fp8_portable": LLM(str(dense), quantization="fp8", op_kernels={"fp8_linear": "paddle_fp8_linear"},
                                    **engine_args),
                "float32": LLM(str(dense), **engine_args)}
        for running in (1, 16):
            t = decode_forward(llms, running, pairs=3 if args.quick else 8)
            print(f"4. dense 54M Qwen2 (bench/throughput.py's), decode step forward, {running:2d} running: fp8 "
                  f"(cpu_native_fp8_linear) {t['fp8'] * 1e3:.1f} ms, fp8 portable {t['fp8_portable'] * 1e3:.1f} ms, "
                  f"float32 {t['float32'] * 1e3:.1f} ms; fp8/float32 {t['fp8'] / t['float32']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
