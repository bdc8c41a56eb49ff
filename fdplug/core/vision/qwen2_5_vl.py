"""Qwen2.5-VL's vision tower in Paddle: patches of one image or video -> its placeholder tokens' features.

The tower, as transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` computes it:

1. patch embedding: a Conv3d whose kernel equals its stride is one matmul over each flattened
   ``[channels * temporal_patch * patch * patch]`` patch;
2. the patches, which arrive grouped by ``merge x merge`` block (`image_processing.patchify`), are
   reordered window by window (``window_size`` pixels square, in merged units), and so are their
   2-D rotary angles (height then width index of each patch, rotating each head's two halves);
3. blocks of pre-norm attention + SwiGLU: attention within each window, except the
   ``fullatt_block_indexes`` blocks, which see a whole frame;
4. the merger: RMSNorm per patch, then each block of ``merge²`` patches concatenated through a
   two-layer GELU MLP into one token of the language model's hidden size; the windows' order is undone.

One item at a time (the encoder cache holds items), float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from fdplug.errors import ModelLoadError
from fdplug.plugin_api.ops import Kernels

FULL_ATTENTION_BLOCKS = (7, 15, 23, 31)   # transformers' default (Qwen2.5-VL-7B's)


@dataclass(frozen=True, slots=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = FULL_ATTENTION_BLOCKS
    in_channels: int = 3
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> VisionConfig:
        vision = raw.get("vision_config")
        if not isinstance(vision, dict):
            raise ModelLoadError("config.json has no vision_config: the vision tower cannot be built.",
                                 fix="use the vision-language checkpoint's own config.json.")
        if vision.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"vision hidden_act {vision.get('hidden_act')!r} is not supported (only silu).",
                                 fix="use a Qwen2.5-VL checkpoint.")
        theta = (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        keys = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size",
                "spatial_merge_size", "temporal_patch_size", "window_size", "in_channels")
        values = {k: int(vision[k]) for k in keys if k in vision}
        missing = [k for k in keys[:5] if k not in values]
        if missing:
            raise ModelLoadError(f"vision_config lacks {', '.join(missing)}.", fix="use the checkpoint's config.json.")
        full = tuple(vision.get("fullatt_block_indexes", FULL_ATTENTION_BLOCKS))
        return cls(**values, fullatt_block_indexes=full, rope_theta=float(theta))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the tower (names under ``visual.``) and its shape."""
        d, i, m = self.hidden_size, self.intermediate_size, self.hidden_size * self.spatial_merge_size ** 2
        shapes = {"patch_embed.proj.weight": (d, self.in_channels, self.temporal_patch_size, self.patch_size,
                                              self.patch_size),
                  "merger.ln_q.weight": (d,), "merger.mlp.0.weight": (m, m), "merger.mlp.0.bias": (m,),
                  "merger.mlp.2.weight": (self.out_hidden_size, m), "merger.mlp.2.bias": (self.out_hidden_size,)}
        for b in range(self.depth):
            p = f"blocks.{b}."
            shapes |= {p + "norm1.weight": (d,), p + "norm2.weight": (d,), p + "attn.qkv.weight": (3 * d, d),
                       p + "attn.qkv.bias": (3 * d,), p + "attn.proj.weight": (d, d), p + "attn.proj.bias": (d,)}
            for name, shape in (("gate_proj", (i, d)), ("up_proj", (i, d)), ("down_proj", (d, i))):
                shapes |= {p + f"mlp.{name}.weight": shape, p + f"mlp.{name}.bias": (shape[0],)}
        return shapes


def window_order(grid: tuple[int, int, int], cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """The merged blocks' order window by window, and the windows' patch boundaries (cu_seqlens)."""
    t, h, w = grid[0], grid[1] // cfg.spatial_merge_size, grid[2] // cfg.spatial_merge_size
    side = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
    index = np.arange(t * h * w).reshape(t, h, w)
    rows, cols = -(-h // side), -(-w // side)
    padded = np.full((t, rows * side, cols * side), -1)
    padded[:, :h, :w] = index
    windows = padded.reshape(t, rows, side, cols, side).transpose(0, 1, 3, 2, 4).reshape(t * rows * cols, -1)
    order = windows[windows >= 0]
    sizes = (windows >= 0).sum(axis=1)
    bounds = np.concatenate([[0], np.cumsum(sizes[sizes > 0])]) * cfg.spatial_merge_size ** 2
    return order, bounds


def rotary_angles(grid: tuple[int, int, int], m: int, head_dim: int, theta: float) -> np.ndarray:
    """``[patches, head_dim]`` rotary angles of each patch in block order (``m x m`` merge blocks):
    height, width, repeated; every frame alike (the towers' axial 2-D RoPE)."""
    t, h, w = grid
    hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    blocks = (h // m, m, w // m, m)
    hpos, wpos = (p.reshape(blocks).transpose(0, 2, 1, 3).ravel() for p in (hpos, wpos))
    spatial = head_dim // 2
    inv = 1.0 / theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial)
    freqs = np.concatenate([hpos[:, None].astype(np.float32) * inv, wpos[:, None].astype(np.float32) * inv], axis=1)
    return np.tile(np.tile(freqs, (t, 1)), (1, 2))


class Qwen25VisionTower:
    """The tower's weights (float32 paddle tensors by name) and `encode`."""

    def __init__(self, cfg: VisionConfig, weights: dict[str, Any], kernels: Kernels) -> None:
        """``kernels``: the selected ops (`fdplug.plugin_api.ops`): ``rms_norm``, ``rope``, ``swiglu``,
        ``vision_attention``; the linears are paddle's matmuls."""
        self.cfg, self.kernels = cfg, kernels
        # linear weights [out, in] transposed once, for x @ w; gate and up fused (the swiglu op's input)
        self.w = {name: value.t().contiguous() if len(value.shape) == 2 else value for name, value in weights.items()}
        for b in range(cfg.depth):
            p = f"blocks.{b}.mlp."
            self.w[p + "gate_up.weight"] = paddle.concat([self.w.pop(p + "gate_proj.weight"),
                                                          self.w.pop(p + "up_proj.weight")], axis=1)
            self.w[p + "gate_up.bias"] = paddle.concat([self.w.pop(p + "gate_proj.bias"),
                                                        self.w.pop(p + "up_proj.bias")])
        self.patch_weight = weights["patch_embed.proj.weight"].reshape([cfg.hidden_size, -1]).t().contiguous()

    def encode(self, patches: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
        """``patches [t*h*w, channels * temporal_patch * patch²]`` (block order) -> features
        ``[t*h*w / merge², out_hidden_size]``."""
        cfg, w = self.cfg, self.w
        unit = cfg.spatial_merge_size ** 2
        order, window_bounds = window_order(grid, cfg)
        patch_order = (order[:, None] * unit + np.arange(unit)).ravel()
        frame = grid[1] * grid[2]
        frame_bounds = np.arange(grid[0] + 1) * frame
        angles = rotary_angles(grid, cfg.spatial_merge_size, cfg.head_dim, cfg.rope_theta)[patch_order]
        cos, sin = rotary_tables(angles, 2 * cfg.num_heads)
        with paddle.no_grad():
            x = paddle.to_tensor(np.ascontiguousarray(patches[patch_order], dtype=np.float32)) @ self.patch_weight
            for b in range(cfg.depth):
                bounds = frame_bounds if b in cfg.fullatt_block_indexes else window_bounds
                x = self._block(x, f"blocks.{b}.", cos, sin, bounds)
            merged = self.kernels.rms_norm(x, w["merger.ln_q.weight"], 1e-6).reshape([-1, cfg.hidden_size * unit])
            merged = F.gelu(F.linear(merged, w["merger.mlp.0.weight"], w["merger.mlp.0.bias"]))
            merged = F.linear(merged, w["merger.mlp.2.weight"], w["merger.mlp.2.bias"])
            out = merged.numpy()
        restored = np.empty_like(out)
        restored[order] = out
        return restored

    def _block(self, x: Any, p: str, cos: Any, sin: Any, bounds: np.ndarray) -> Any:
        w, heads, ops = self.w, self.cfg.num_heads, self.kernels
        h = ops.rms_norm(x, w[p + "norm1.weight"], 1e-6)
        qkv = F.linear(h, w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"]).reshape([0, 3 * heads, -1])
        qk, v = paddle.split(qkv, [2 * heads, heads], axis=1)
        q, k = paddle.split(ops.rope(qk, cos, sin), 2, axis=1)
        attn = ops.vision_attention(q, k, v, bounds, self.cfg.head_dim ** -0.5).reshape([0, -1])
        x = x + F.linear(attn, w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
        h = ops.swiglu(F.linear(ops.rms_norm(x, w[p + "norm2.weight"], 1e-6), w[p + "mlp.gate_up.weight"],
                                w[p + "mlp.gate_up.bias"]))
        return x + F.linear(h, w[p + "mlp.down_proj.weight"], w[p + "mlp.down_proj.bias"])


def rotary_tables(angles: np.ndarray, heads: int) -> tuple[Any, Any]:
    """``cos``, ``sin`` ``[patches, heads, head_dim]`` as the ``rope`` op takes them (`fdplug.plugin_api.ops`:
    tiled over the heads, ``sin``'s first half negated)."""
    half = angles.shape[-1] // 2
    sin = np.sin(angles)
    sin[:, :half] *= -1
    return tuple(paddle.to_tensor(np.ascontiguousarray(np.broadcast_to(t[:, None, :], (len(t), heads, t.shape[-1]))))
                 for t in (np.cos(angles), sin))
