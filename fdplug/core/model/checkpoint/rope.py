"""Rotary position embedding parameters: the four RoPE types fdplug implements, in numpy.

This mirrors transformers' ``ROPE_INIT_FUNCTIONS`` (``default``, ``linear``, ``llama3``, ``yarn``)
so a checkpoint's positions mean the same thing here as they did in training. It is pure numpy
(no paddle) so the config can be parsed and checked without a device; ``layers.RotaryEmbedding``
turns the result into a cos/sin cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fdplug.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """One model's RoPE: the base ``theta``, the scaling ``type`` and that type's parameters.

    ``interleaved`` is the GPT-J/GLM pairing (dims ``2i, 2i+1`` rotate together, ERNIE-4.5) rather
    than the GPT-NeoX one (dims ``i, i + d/2``); ``partial`` is the fraction of each head's dims
    that rotate (``partial_rotary_factor``, GLM-4.5: the first half; the rest pass through). The
    loader permutes q/k weights (`rope_permutation`) so the decoder only ever applies the NeoX form
    over the whole head, with ``cos = 1, sin = 0`` on the dims that do not rotate.
    """

    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    interleaved: bool = False
    partial: float = 1.0
    mrope_section: tuple[int, ...] = ()
    """Multimodal RoPE: how many of the ``rotary_dim // 2`` frequencies rotate by the temporal,
    height and width position of a token (each token then has three positions, equal for text);
    empty: one position per token. `mrope_axes` says which frequency follows which."""
    mrope_interleaved_hw: bool = False
    """ERNIE-4.5-VL's assignment: ``mrope_section`` is (height, width, temporal) sizes, and the
    first ``height + width`` frequencies alternate height, width; Qwen2-VL's: (temporal, height,
    width) in consecutive runs."""

    def mrope_axes(self) -> np.ndarray:
        """The position axis (0 temporal, 1 height, 2 width) each rotary frequency rotates by."""
        if not self.mrope_interleaved_hw:
            return np.repeat(np.arange(3), self.mrope_section)
        hw = self.mrope_section[0] + self.mrope_section[1]
        return np.concatenate([1 + np.arange(hw) % 2, np.zeros(self.mrope_section[2], dtype=np.int64)])
    freq_factors: tuple[float, ...] = ()
    """Per-frequency divisors of the inverse frequencies, as a GGUF file stores Llama 3.1's scaling
    (``rope_freqs.weight``: llama.cpp's converter computes them from the ``llama3`` parameters, which
    the file then omits); empty: none."""

    def rotary_dim(self, head_dim: int) -> int:
        """How many of a head's ``head_dim`` dims rotate (transformers: ``int(head_dim * partial)``)."""
        return int(head_dim * self.partial)


def parse_rope(raw: dict[str, Any], *, default_theta: float, max_position_embeddings: int,
               interleaved: bool = False, default_partial: float = 1.0, mrope_interleaved_hw: bool = False,
               default_mrope: tuple[int, ...] = ()) -> RopeConfig:
    """Read RoPE settings from an HF ``config.json`` dict, transformers 4.x or 5.x style.

    4.x keeps ``rope_theta`` at the top level and scaling in ``rope_scaling`` (``type`` or
    ``rope_type``); 5.x puts everything in ``rope_parameters``. As in transformers, ``rope_scaling``
    wins over ``rope_parameters`` and a top-level ``original_max_position_embeddings`` wins over
    the one inside the scaling dict.
    """
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    mrope = params.get("mrope_section", default_mrope or None)
    if rope_type == "mrope":   # transformers 4.x's name for default RoPE with an mrope_section
        rope_type = "default"
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", default_partial))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"RoPE type {rope_type!r} is not supported (supported: "
                                    f"{', '.join(SUPPORTED_ROPE_TYPES)}).",
                                    fix="use a checkpoint whose rope_scaling/rope_parameters uses a supported type.")
    partial = default_partial if partial is None else partial
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ModelLoadError(f"partial_rotary_factor={partial!r} must be a number in (0, 1].",
                             fix="fix the model's config.json (compare with the original checkpoint's).")
    original = raw.get("original_max_position_embeddings",
                       params.get("original_max_position_embeddings", max_position_embeddings))
    kw: dict[str, Any] = {"theta": float(theta), "type": rope_type, "interleaved": interleaved,
                          "partial": float(partial),
                          "original_max_position_embeddings": int(original)}
    if mrope is not None:
        kw["mrope_section"], kw["mrope_interleaved_hw"] = _mrope_section(mrope), mrope_interleaved_hw
    if rope_type == "linear":
        kw["factor"] = float(_need(params, "factor", rope_type))
    elif rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            kw[key] = float(_need(params, key, rope_type))
    elif rope_type == "yarn":
        factor = params.get("factor")
        kw["factor"] = float(factor) if factor is not None else max_position_embeddings / int(original)
        kw["beta_fast"] = float(params.get("beta_fast") or 32)
        kw["beta_slow"] = float(params.get("beta_slow") or 1)
        kw["truncate"] = bool(params.get("truncate", True))
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            kw[key] = None if params.get(key) is None else float(params[key])
    return RopeConfig(**kw)


def _mrope_section(value: Any) -> tuple[int, ...]:
    if (not isinstance(value, (list, tuple)) or len(value) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
        raise ModelLoadError(f"mrope_section={value!r} must be three non-negative integers (temporal, height, "
                             "width frequencies).", fix="fix the model's config.json (compare with the original "
                             "checkpoint's).")
    return tuple(value)


def _need(params: dict[str, Any], key: str, rope_type: str) -> Any:
    if params.get(key) is None:
        raise ModelLoadError(f"RoPE type {rope_type!r} needs {key!r} in rope_scaling/rope_parameters.",
                             fix="fix the model's config.json (compare with the original checkpoint's).")
    return params[key]


def inv_freq(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[rotary_dim // 2]`` (float32) and the factor applied to cos/sin."""
    dim = rope.rotary_dim(head_dim)
    base = rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv = 1.0 / base
    scale = 1.0
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":
        inv = _llama3(inv, rope)
    elif rope.type == "yarn":
        inv, scale = _yarn(base, rope, dim)
    if rope.freq_factors:    # one a frequency (`ModelConfig.validate`)
        inv = inv / np.asarray(rope.freq_factors, dtype=np.float64)
    return inv.astype(np.float32), float(scale)


def _llama3(inv: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    old = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn(base: np.ndarray, rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale cos/sin."""
    factor = rope.factor

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero, as transformers does
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * base)) * (1 - extrapolation) + (1.0 / base) * extrapolation
    return inv, attention_factor


def cos_sin(rope: RopeConfig, head_dim: int, num_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` tables ``[num_positions, head_dim]`` (float32) in NeoX layout.

    The angle is computed as transformers does (float32 position times float32 frequency), so the
    tables match the reference bit-for-bit up to the last ulp of ``cos``/``sin``. With partial
    rotary each half is ``[rotating dims, passing dims]`` (the layout `rope_permutation` makes),
    the passing ones ``cos = 1, sin = 0`` (no attention factor: transformers leaves them untouched).
    """
    inv, scale = inv_freq(rope, head_dim)
    freqs = (np.arange(num_positions, dtype=np.float32)[:, None] * inv[None, :]).astype(np.float64)
    passing = np.zeros((num_positions, (head_dim - rope.rotary_dim(head_dim)) // 2))
    cos = np.concatenate([np.cos(freqs) * scale, passing + 1.0], axis=-1)
    sin = np.concatenate([np.sin(freqs) * scale, passing], axis=-1)
    return np.tile(cos, 2).astype(np.float32), np.tile(sin, 2).astype(np.float32)


def rope_permutation(rope: RopeConfig, head_dim: int) -> np.ndarray | None:
    """Per-head dim order that turns a checkpoint's q/k into the decoder's layout; None: as stored.

    The decoder rotates pairs ``(i, i + d/2)`` over the whole head (GPT-NeoX). An interleaved
    checkpoint pairs ``(2i, 2i+1)``; a partial one rotates only its first ``r`` dims (pairs
    ``(i, i + r/2)``) and passes the rest. The permutation puts each pair's halves at ``i`` and
    ``i + d/2`` and the passing dims after them in each half. Applied to q and k alike (weights,
    biases, per-head norms) it leaves every q.k dot product unchanged: no per-step cost.
    """
    r = rope.rotary_dim(head_dim)
    if not rope.interleaved and r == head_dim:
        return None
    rotating = np.arange(r)
    first, second = (rotating[0::2], rotating[1::2]) if rope.interleaved else (rotating[: r // 2], rotating[r // 2:])
    passing = np.arange(r, head_dim)
    half = (head_dim - r) // 2
    return np.concatenate([first, passing[:half], second, passing[half:]])
