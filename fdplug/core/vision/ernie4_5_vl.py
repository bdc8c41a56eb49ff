"""ERNIE-4.5-VL's vision side in Paddle: the ViT and the variable-resolution resampler.

As transformers' ``Ernie4_5_VLMoeVisionTransformerPretrainedModel`` and
``Ernie4_5_VLMoeVariableResolutionResamplerModel`` compute it:

1. patch embedding: one matmul over each flattened ``[channels * patch * patch]`` patch (a still
   image is one frame: no temporal patch);
2. pre-norm blocks (LayerNorm, attention with Qwen2-VL's axial 2-D RoPE over each whole frame, a
   quick-GELU MLP), then a final LayerNorm;
3. the resampler: each ``merge x merge`` block of patches concatenated, through a spatial MLP
   (GELU, LayerNorm); then pairs of frames concatenated (an image pairs with itself), through a
   temporal MLP; a projection to the language model's width and an RMSNorm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from fdplug.core.vision.qwen2_5_vl import rotary_angles, rotary_tables
from fdplug.errors import ModelLoadError
from fdplug.plugin_api.ops import Kernels


@dataclass(frozen=True, slots=True)
class ErnieVisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int              # the language model's hidden size
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_merge_size: int = 2
    in_channels: int = 3
    eps: float = 1e-6                 # the tower's LayerNorms (vision_config.rms_norm_eps)
    out_eps: float = 1e-5             # the resampler's final RMSNorm (the language model's rms_norm_eps)
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ErnieVisionConfig:
        vision, text = raw.get("vision_config"), {**raw, **(raw.get("text_config") or {})}
        if not isinstance(vision, dict):
            raise ModelLoadError("config.json has no vision_config: the vision tower cannot be built.",
                                 fix="use the vision-language checkpoint's own config.json.")
        if vision.get("hidden_act", "quick_gelu") != "quick_gelu":
            raise ModelLoadError(f"vision hidden_act {vision.get('hidden_act')!r} is not supported (quick_gelu is).",
                                 fix="use an ERNIE-4.5-VL checkpoint.")
        keys = ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "spatial_merge_size",
                "temporal_merge_size", "in_channels")
        values = {k: int(vision[k]) for k in keys if k in vision}
        missing = [k for k in keys[:4] if k not in values]
        if missing or "hidden_size" not in text:
            raise ModelLoadError(f"vision_config lacks {', '.join(missing) or 'nothing'}; config.json "
                                 f"{'has' if 'hidden_size' in text else 'lacks'} hidden_size.",
                                 fix="use the checkpoint's config.json.")
        theta = (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(**values, out_hidden_size=int(text["hidden_size"]), eps=float(vision.get("rms_norm_eps", 1e-6)),
                   out_eps=float(text.get("rms_norm_eps", 1e-5)), rope_theta=float(theta))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the tower (``vision_model.``) and the resampler (``resampler_model.``)."""
        d, i, m = self.hidden_size, self.intermediate_size, self.hidden_size * self.spatial_merge_size ** 2
        shapes = {"vision_model.patch_embed.proj.weight": (d, self.in_channels * self.patch_size ** 2),
                  "vision_model.ln.weight": (d,), "vision_model.ln.bias": (d,),
                  "resampler_model.mlp.weight": (self.out_hidden_size, m),
                  "resampler_model.mlp.bias": (self.out_hidden_size,),
                  "resampler_model.after_norm.weight": (self.out_hidden_size,)}
        for mlp, inputs in (("spatial_linear", m), ("temporal_linear", m * self.temporal_merge_size)):
            p = f"resampler_model.{mlp}."
            shapes |= {p + "0.weight": (m, inputs), p + "0.bias": (m,), p + "2.weight": (m, m), p + "2.bias": (m,),
                       p + "3.weight": (m,), p + "3.bias": (m,)}
        for b in range(self.depth):
            p = f"vision_model.blocks.{b}."
            for name, shape in (("norm1", (d,)), ("norm2", (d,)), ("attn.qkv", (3 * d, d)), ("attn.proj", (d, d)),
                                ("mlp.fc1", (i, d)), ("mlp.fc2", (d, i))):
                shapes |= {p + name + ".weight": shape, p + name + ".bias": (shape[0],)}
        return shapes


class Ernie45VisionTower:
    """The tower and resampler weights (float32 paddle tensors by name) and `encode`."""

    def __init__(self, cfg: ErnieVisionConfig, weights: dict[str, Any], kernels: Kernels) -> None:
        """``kernels``: the selected ops (`fdplug.plugin_api.ops`): ``rope``, ``vision_attention``."""
        self.cfg, self.kernels = cfg, kernels
        self.w = {name: value.t().contiguous() if len(value.shape) == 2 else value for name, value in weights.items()}

    def encode(self, patches: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
        """``patches [t*h*w, channels * patch²]`` (block order) -> ``[tokens, out_hidden_size]``."""
        cfg, w = self.cfg, self.w
        frame = grid[1] * grid[2]
        cos, sin = rotary_tables(rotary_angles(grid, cfg.spatial_merge_size, cfg.head_dim, cfg.rope_theta),
                                 2 * cfg.num_heads)
        with paddle.no_grad():
            x = paddle.to_tensor(np.ascontiguousarray(patches, dtype=np.float32))
            x = x @ w["vision_model.patch_embed.proj.weight"]
            for b in range(cfg.depth):
                x = self._block(x, f"vision_model.blocks.{b}.", cos, sin, np.arange(grid[0] + 1) * frame)
            x = self._layer_norm(x, "vision_model.ln")
            x = self._mlp(x.reshape([-1, cfg.hidden_size * cfg.spatial_merge_size ** 2]), "spatial_linear")
            x = self._mlp(_pair_frames(x, grid[0], frame // cfg.spatial_merge_size ** 2), "temporal_linear")
            x = F.linear(x, w["resampler_model.mlp.weight"], w["resampler_model.mlp.bias"])
            norm = paddle.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.out_eps)
            return (w["resampler_model.after_norm.weight"] * (x * norm)).numpy()

    def _block(self, x: Any, p: str, cos: Any, sin: Any, bounds: np.ndarray) -> Any:
        w, heads = self.w, self.cfg.num_heads
        qkv = F.linear(self._layer_norm(x, p + "norm1"), w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"])
        qk, v = paddle.split(qkv.reshape([0, 3 * heads, -1]), [2 * heads, heads], axis=1)
        q, k = paddle.split(self.kernels.rope(qk, cos, sin), 2, axis=1)
        attn = self.kernels.vision_attention(q, k, v, bounds, self.cfg.head_dim ** -0.5)
        x = x + F.linear(attn.reshape([0, -1]), w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
        h = F.linear(self._layer_norm(x, p + "norm2"), w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"])
        h = h * F.sigmoid(1.702 * h)    # quick_gelu
        return x + F.linear(h, w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"])

    def _mlp(self, x: Any, name: str) -> Any:
        p, w = f"resampler_model.{name}.", self.w
        x = F.linear(F.gelu(F.linear(x, w[p + "0.weight"], w[p + "0.bias"])), w[p + "2.weight"], w[p + "2.bias"])
        return F.layer_norm(x, x.shape[-1:], w[p + "3.weight"], w[p + "3.bias"], self.cfg.eps)

    def _layer_norm(self, x: Any, name: str) -> Any:
        return F.layer_norm(x, x.shape[-1:], self.w[name + ".weight"], self.w[name + ".bias"], self.cfg.eps)


def _pair_frames(x: Any, frames: int, per_frame: int) -> Any:
    """Frames ``2i`` and ``2i+1`` side by side (``[frames / 2 * per_frame, 2 * width]``); a single
    frame (an image) beside itself."""
    rows = np.arange(frames * per_frame).reshape(frames, per_frame)
    even, odd = (rows[0::2], rows[1::2]) if frames > 1 else (rows, rows)
    return paddle.concat([paddle.gather(x, paddle.to_tensor(even.ravel())),
                          paddle.gather(x, paddle.to_tensor(odd.ravel()))], axis=-1)
