"""Write a float checkpoint as an FP8 block checkpoint, the format DeepSeek-V3 and HF's FP8 models use.

Each linear layer of the decoder (attention projections, MLP and expert gate/up/down) becomes
``weight`` (e4m3) plus ``weight_scale_inv`` (float32 per ``block`` tile, `fp8.block_quant`); fused
experts ``experts.gate_up_proj`` ``[E, 2I, H]`` get ``experts.gate_up_proj_scale_inv`` ``[E, ...]``;
embeddings, norms, routers, ``lm_head`` and the modules in ``keep`` stay as they were, and
``config.json`` gains the ``quantization_config`` that says so. ``dequantized`` also writes the
quantized weights back in float32: a float checkpoint with exactly the FP8 model's numbers, the
reference its outputs are checked against. ``tools/make_fp8_checkpoint.py`` is the command line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")   # [E, N, K]: one scale grid per expert


def converted(name: str, keep: tuple[str, ...]) -> bool:
    """Whether checkpoint tensor ``name`` is a decoder linear's weight (or a fused experts tensor)
    that gets quantized."""
    module = name.removesuffix(".weight")
    linear = name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS
    return (linear or name.endswith(FUSED_EXPERTS)) and not any(fragment in module for fragment in keep)


def quantize_checkpoint(src: Path, dst: Path, *, block: tuple[int, int] = (128, 128), keep: tuple[str, ...] = (),
                        dequantized: Path | None = None) -> int:
    """Write ``src`` (a model dir with ``model.safetensors``) to ``dst`` as FP8; returns the number of
    tensors quantized. The other files of ``src`` (tokenizer, generation config) are copied."""
    from safetensors import safe_open

    from fdplug.plugin_api.fp8 import block_dequant, block_quant

    if not (Path(src) / "model.safetensors").is_file():
        raise FileNotFoundError(f"{src}/model.safetensors is missing (sharded checkpoints are not handled here)")
    fp8, floats, count = {}, {}, 0
    with safe_open(str(Path(src) / "model.safetensors"), framework="paddle") as f:
        for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            w = f.get_tensor(name)
            if not converted(name, keep):
                fp8[name] = floats[name] = w
                continue
            q, scale_inv = block_quant(w.astype("float32"), block)
            fp8[name], fp8[name + "_scale_inv"] = q, scale_inv
            floats[name] = block_dequant(q, scale_inv, block)
            count += 1
    config = json.loads((Path(src) / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
             "modules_to_not_convert": list(keep)}
    _write(src, dst, fp8, config | {"quantization_config": quant})
    if dequantized is not None:
        # float32 values (an e4m3 times its scale) that bf16 cannot hold: say so, or dtype=auto rounds them
        _write(src, dequantized, floats, config | {k: "float32" for k in ("torch_dtype", "dtype") if k in config})
    return count


def _write(src: Path, out: Path, tensors: dict, config: dict) -> None:
    from safetensors.paddle import save_file

    out.mkdir(parents=True, exist_ok=False)
    for f in Path(src).iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
