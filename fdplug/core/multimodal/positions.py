"""Multimodal RoPE positions (Qwen2-VL, Qwen2.5-VL): three positions per token, from the items' grids.

A text token has one position repeated three times (temporal, height, width). The tokens of an
image or video item, laid out row-major over its merged grid ``(t, h / merge, w / merge)``, take
``base + (t_index * interval, h_index, w_index)``, where ``base`` is the position the item's first
token would have as text, and ``interval`` spaces video frames in time (``tokens_per_second`` times
the seconds a temporal patch covers; 1 for an image). The text after an item continues from the
item's largest position + 1, so an item of ``L`` tokens moves every later position by
``span - L``, with ``span = max((t - 1) * interval, h / merge - 1, w / merge - 1) + 1``.

Every position is a function of the token's index and the request's items alone, computed per
step for the tokens the step runs: a prefill chunk that cuts an image, a request resumed after
preemption and a prefix-cache hit all give each token the position a whole-prompt pass gives it.
Decode tokens sit past every item, at ``index + delta`` (`position_delta`).

For an image this is transformers' ``get_rope_index`` exactly; for a video the next text starts
after the largest temporal position too, as in the original Qwen2.5-VL code and vLLM (transformers
5.18 advances by ``max(h, w) / merge`` only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fdplug.plugin_api.scheduled_work import MMPlaceholder


@dataclass(frozen=True, slots=True)
class MRopeRule:
    """What a model's positions depend on besides the items: its merge size and video spacing."""

    merge_size: int = 2
    video_interval: float = 1.0   # tokens_per_second * seconds per temporal patch
    temporal_merge: int = 1       # a video's temporal patches per token row (ERNIE-4.5-VL: 2)

    def interval(self, item: MMPlaceholder) -> float:
        return self.video_interval if item.modality == "video" else 1.0

    def merged_grid(self, item: MMPlaceholder) -> tuple[int, int, int]:
        t, h, w = item.grid_thw
        frames = t // self.temporal_merge if item.modality == "video" else t
        return frames, h // self.merge_size, w // self.merge_size

    def span(self, item: MMPlaceholder) -> int:
        """Positions the item occupies: its largest (t, h, w) offset + 1."""
        t, h, w = self.merged_grid(item)
        return max(int((t - 1) * self.interval(item)), h - 1, w - 1) + 1

    def position_delta(self, items: Sequence[MMPlaceholder]) -> int:
        """Position minus index of every token after the last item (decode tokens)."""
        return sum(self.span(item) - item.length for item in items if item.grid_thw)

    def positions(self, index: np.ndarray, items: Sequence[MMPlaceholder]) -> np.ndarray:
        """``[3, n]`` int64 positions of the tokens at ``index`` (one request's, any order)."""
        out = np.broadcast_to(index, (3, len(index))).copy()
        shift = 0
        for item in sorted(items, key=lambda it: it.offset):
            if not item.grid_thw:
                continue
            t, h, w = self.merged_grid(item)
            inside = (index >= item.offset) & (index < item.end)
            if inside.any():
                k = index[inside] - item.offset
                base = item.offset + shift
                out[0, inside] = base + np.floor((k // (h * w)) * self.interval(item)).astype(np.int64)
                out[1, inside] = base + (k // w) % h
                out[2, inside] = base + k % w
            moved = self.span(item) - item.length
            out[:, index >= item.end] += moved
            shift += moved
        return out
