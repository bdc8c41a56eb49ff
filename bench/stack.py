"""The cpu plugin's fused decoder stack against the same engine layer by layer.

    python bench/stack.py                   # SmolLM2-135M's sizes, random float32 and bf16 weights
    python bench/stack.py --gguf FILE       # a GGUF file instead (e.g. ~/.cache/fdplug/models/*.gguf)
    python bench/stack.py --quick           # fewer pairs

`cpu_native_decoder_stack` (`fdplug/plugins/cpu/native_stack.py`) runs every layer of a decode-only
step in one compiled call of the kernels the layers run one by one, bit for bit their result. Two
engines on one model, alternated in ABBA order, medians: as selected but with the float linears
pinned to ``cpu_native_linear`` (the stack needs every float layer packed; the startup timing may
put a shape on paddle's matmul instead, and then the stack declines), against the same with
``--op-kernel decoder_stack=paddle_layer_by_layer``. Figures: single-stream decode (tokens/s,
`bench/levels.py`'s measure) and 64 requests of 128 prompt + 64 output tokens (output tokens/s).
The first line names the CPU and the level the kernels were built for.
"""  # noqa: E501 (printed verbatim by --help: RawDescriptionHelpFormatter)

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from levels import SMOLLM2, batch_tokens_per_s, decode_tokens_per_s, start
from linear import abba

from fdplug.demo.random_model import write_random_model

LAYER_BY_LAYER = {"decoder_stack": "paddle_layer_by_layer"}


def compare(model: str, pairs: int, **engine_args) -> dict[str, tuple[float, float]]:
    """{figure: (stack, layer by layer)} for ``model``."""
    from fdplug.core.frontend.llm import LLM

    args = {"max_model_len": 2048, "max_num_seqs": 64, "num_kv_blocks": 1024, **engine_args}
    pinned = {} if model.endswith(".gguf") else {"linear": "cpu_native_linear"}
    llms = {"stack": LLM(model, op_kernels=pinned, **args),
            "layers": LLM(model, op_kernels={**pinned, **LAYER_BY_LAYER}, **args)}
    if llms["stack"].engine.runner.model.fused_stack is None:
        raise SystemExit(f"the decoder stack declined {model}: see the startup log (-v)")
    figures = {"single-stream decode (tok/s)": abba(llms, pairs, decode_tokens_per_s),
               "64 requests (output tok/s)": abba(llms, max(2, pairs // 3), batch_tokens_per_s)}
    return {name: (got["stack"], got["layers"]) for name, got in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="a GGUF file to run instead of the random float model")
    args, pairs = start(parser)
    with tempfile.TemporaryDirectory() as tmp:
        if args.gguf:
            runs = {"gguf": (args.gguf, {})}
        else:
            write_random_model(Path(tmp), **SMOLLM2)
            runs = {"float32": (tmp, {}), "bf16 weights": (tmp, {"dtype": "bfloat16"})}
        for name, (model, engine_args) in runs.items():
            for figure, (stack, layers) in compare(model, pairs, **engine_args).items():
                print(f"{name}: {figure}: stack {stack:.2f}, layer by layer {layers:.2f} -> {stack / layers:.2f}x")


if __name__ == "__main__":
    main()
