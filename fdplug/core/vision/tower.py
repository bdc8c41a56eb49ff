"""A vision-language checkpoint's vision tower: which one, read from its safetensors files.

The language side is loaded by `fdplug.core.model.loader`, which leaves the ``visual.`` tensors
here. Every tensor the tower needs must be present with its shape, and no other ``visual.`` tensor
may be: a mismatch is a WeightMismatchError naming the tensor, as for the language side.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import paddle

from fdplug.core.vision.ernie4_5_vl import Ernie45VisionTower, ErnieVisionConfig
from fdplug.core.vision.qwen2_5_vl import Qwen25VisionTower, VisionConfig
from fdplug.errors import UnsupportedModelError, WeightMismatchError

# architecture -> (its config, its tower, the prefix its weight names drop)
TOWERS = {"Qwen2_5_VLForConditionalGeneration": (VisionConfig, Qwen25VisionTower, "visual."),
          "Ernie4_5_VLMoeForConditionalGeneration": (ErnieVisionConfig, Ernie45VisionTower, "")}
# the vision side's tensors: Qwen2.5-VL's tower; ERNIE-4.5-VL's tower and resampler
VISION_PREFIXES = ("visual.", "vision_model.", "resampler_model.")


def language_name(name: str) -> str:
    """A checkpoint tensor's name as fdplug reads it: transformers 5 saves a vision-language model's
    language side under ``model.language_model.`` and Qwen2.5-VL's tower under ``model.visual.`` (the
    original checkpoints: ``model.`` and ``visual.``; ERNIE-4.5-VL's: ``model.vision_model.`` and
    ``model.resampler_model.``); the language loader leaves the `VISION_PREFIXES` here."""
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    stripped = name.removeprefix("model.")
    return stripped if stripped.startswith(VISION_PREFIXES) else name


def load_tower(model_dir: str | Path, files: list[Path], architecture: str, kernels: Any) -> Any:
    """The tower of the ``architecture`` checkpoint in ``model_dir`` (its safetensors ``files``), float32
    paddle tensors, computing with the selected ops ``kernels`` (`fdplug.plugin_api.ops.Kernels`)."""
    from safetensors import safe_open

    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    if architecture not in TOWERS:
        raise UnsupportedModelError(f"no vision tower for {architecture}; fdplug runs the towers of "
                                    f"{', '.join(TOWERS)}.", fix="send pre-encoded features instead.")
    config_type, tower_type, strip = TOWERS[architecture]
    cfg = config_type.from_hf(raw)
    shapes = cfg.weight_shapes()
    weights: dict[str, Any] = {}
    for path in files:
        with safe_open(str(path), framework="numpy") as f:
            for stored in f.keys():
                name = language_name(stored)
                if not name.startswith(VISION_PREFIXES):
                    continue
                name = name.removeprefix(strip)
                if name not in shapes:
                    raise WeightMismatchError(f"unexpected vision tensor {stored!r} in {path.name}.", tensor=stored,
                                              fix="check that config.json's vision_config matches the checkpoint.")
                array = f.get_tensor(stored)
                if tuple(array.shape) != shapes[name]:
                    raise WeightMismatchError(f"vision tensor {stored!r} has shape {list(array.shape)}, expected "
                                              f"{list(shapes[name])} from vision_config.", tensor=stored,
                                              fix="check that config.json's vision_config matches the checkpoint.")
                weights[name] = paddle.to_tensor(array.astype("float32"))
    missing = sorted(set(shapes) - set(weights))
    if missing:
        raise WeightMismatchError(f"{len(missing)} vision tensor(s) missing, first {strip + missing[0]!r}.",
                                  tensor=strip + missing[0], fix="download the checkpoint again.")
    return tower_type(cfg, weights, kernels)
