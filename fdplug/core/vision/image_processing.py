"""Pictures -> the patches a Qwen2-VL-family vision tower reads, in numpy and Pillow.

As transformers' ``Qwen2VLImageProcessorPil`` does it, value for value: converted to RGB (Pillow's
``convert``: an alpha channel is dropped, as transformers drops it), resized (bicubic, in 8 bits)
to the nearest multiples of ``patch * merge`` pixels within
``[min_pixels, max_pixels]`` (``smart_resize``), scaled to [0, 1], normalised by the CLIP mean and
std, and cut into ``patch x patch`` squares grouped by ``merge x merge`` block, each repeated over
the ``temporal_patch`` frames a still image stands for.

`probe` reads only an image's header (its format and size) so a request's placeholder tokens, and
every size limit, are known before a byte of pixels is decoded: a 200-byte PNG that claims
100,000 x 100,000 pixels is a 400, never an allocation.
"""

from __future__ import annotations

import io
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fdplug.errors import InvalidRequestError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_SOURCE_PIXELS = 64 * 1024 * 1024   # an image decoded larger than this is refused from its header
MAX_ASPECT = 200
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280   # transformers' defaults
# whose vision towers fdplug runs (`tower`), and their processors' defaults that differ from Qwen2-VL's
PIXEL_ARCHITECTURES: dict[str, dict[str, int]] = {
    "Qwen2_5_VLForConditionalGeneration": {},
    "Ernie4_5_VLMoeForConditionalGeneration": {"temporal_patch_size": 1, "max_pixels": 28 * 28 * 6177},
}


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """The processor's settings (``preprocessor_config.json``; transformers' defaults without one)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD

    @classmethod
    def from_dir(cls, model_dir: str | Path, vision: dict[str, Any], architecture: str) -> ImageSpec:
        path = Path(model_dir) / "preprocessor_config.json"
        raw = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        size = raw.get("size") or {}
        own = PIXEL_ARCHITECTURES[architecture]
        temporal = vision.get("temporal_patch_size", own.get("temporal_patch_size", 2))
        return cls(patch_size=int(raw.get("patch_size", vision.get("patch_size", 14))),
                   merge_size=int(raw.get("merge_size", vision.get("spatial_merge_size", 2))),
                   temporal_patch_size=int(raw.get("temporal_patch_size", temporal)),
                   min_pixels=int(raw.get("min_pixels", size.get("shortest_edge", MIN_PIXELS))),
                   max_pixels=int(raw.get("max_pixels", size.get("longest_edge", own.get("max_pixels", MAX_PIXELS)))),
                   mean=tuple(raw.get("image_mean", CLIP_MEAN)), std=tuple(raw.get("image_std", CLIP_STD)))

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """The patch grid ``(1, h, w)`` of an image of that size."""
        h, w = smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' ``smart_resize``: multiples of ``factor``, pixels within bounds, aspect kept."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def probe(data: bytes, name: str) -> tuple[int, int]:
    """``(width, height)`` from the header alone; a 400 naming ``name`` for anything not a picture
    of a supported format and sane size."""
    from PIL import Image, UnidentifiedImageError

    fix = f"send a {', '.join(FORMATS)} image of at most {MAX_SOURCE_PIXELS // 2**20} Mpixel."
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # PIL warns of large images; the size is checked below
            image = Image.open(io.BytesIO(data))
            fmt, (width, height) = image.format, image.size
    except Image.DecompressionBombError:   # Pillow's own refusal, from the header: far past our limit too
        raise InvalidRequestError(f"{name}'s header claims over {MAX_SOURCE_PIXELS} pixels.", fix=fix,
                                  param="messages") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise InvalidRequestError(f"{name} is not a readable image ({len(data)} bytes): {exc}.", fix=fix,
                                  param="messages") from None
    if fmt not in FORMATS:
        raise InvalidRequestError(f"{name} is a {fmt} image; supported: {', '.join(FORMATS)}.", fix=fix,
                                  param="messages")
    if width < 1 or height < 1 or width * height > MAX_SOURCE_PIXELS:
        raise InvalidRequestError(f"{name} is {width} x {height} pixels; an image needs 1 to {MAX_SOURCE_PIXELS} "
                                  "pixels.", fix=fix, param="messages")
    if max(width, height) / min(width, height) > MAX_ASPECT:
        raise InvalidRequestError(f"{name} is {width} x {height} pixels, an aspect ratio over {MAX_ASPECT}.",
                                  fix="crop or pad the image to a less extreme shape.", param="messages")
    return width, height


def decode(data: bytes, name: str) -> Any:
    """The image as an RGB PIL image (transformers' ``convert_to_rgb``: Pillow's ``convert``)."""
    from PIL import Image

    probe(data, name)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (OSError, ValueError, SyntaxError) as exc:   # a truncated or corrupt body behind a good header
        raise InvalidRequestError(f"{name} could not be decoded: {exc}.", fix="send the whole, valid image file.",
                                  param="messages") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def patchify(image: Any, spec: ImageSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """An RGB PIL image -> ``[h*w, 3 * temporal * patch * patch]`` float32 patches and the grid (1, h, w)."""
    from PIL import Image

    grid = spec.grid(*image.size)
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    resized = np.asarray(image.resize((grid[2] * p, grid[1] * p), resample=Image.BICUBIC))
    pixels = (resized.astype(np.float64) * (1 / 255)).astype(np.float32).transpose(2, 0, 1)
    pixels = (pixels - np.asarray(spec.mean, np.float32)[:, None, None]) / np.asarray(spec.std, np.float32)[:, None,
                                                                                                            None]
    c, gh, gw = 3, grid[1], grid[2]
    blocks = pixels.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return np.ascontiguousarray(frames.reshape(gh * gw, c * t * p * p)), grid
