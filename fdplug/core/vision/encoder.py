"""A picture's bytes -> the features of its placeholder tokens: decode, patchify, run the tower.

Called on the feature loader's threads (`fdplug.core.multimodal.loader`), off the step loop; the
tower holds no state between calls, so several pictures may encode at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fdplug.core.vision.image_processing import ImageSpec, decode, patchify
from fdplug.core.vision.tower import load_tower


class ImageEncoder:
    def __init__(self, model_dir: str | Path, files: list[Path], architecture: str, spec: ImageSpec,
                 kernels: Any) -> None:
        self.tower = load_tower(model_dir, files, architecture, kernels)
        self.spec = spec

    def __call__(self, data: bytes, name: str) -> np.ndarray:
        """``[tokens, hidden_size]`` float32 features of the picture in ``data`` (``name`` for errors)."""
        patches, grid = patchify(decode(data, name), self.spec)
        return self.tower.encode(patches, grid)
