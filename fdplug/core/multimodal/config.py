"""What a model declares about multimodal inputs: placeholder tokens, token counts, mask policy.

Read from ``config.json`` with Qwen2-VL's key names (``image_token_id``, ``video_token_id``,
``vision_start_token_id``, ``vision_end_token_id``, ``vision_config.spatial_merge_size``; ERNIE-4.5-VL's
``image_start_token_id``/``image_end_token_id``) plus ``fdplug_mm_mask_policy``: ``causal`` (image
tokens attend like text: the default, as transformers runs Qwen2.5-VL and ERNIE-4.5-VL) or
``bidirectional_items`` (every token of an image sees the whole image; a video is bidirectional
within each row of 2 frames).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fdplug.errors import InvalidRequestError, ModelLoadError, show_value

if TYPE_CHECKING:   # (numpy: not imported before the engine process sets its scheduler slice)
    from fdplug.core.multimodal.positions import MRopeRule
    from fdplug.core.vision.image_processing import ImageSpec

MASK_POLICIES = ("causal", "bidirectional_items")
TOKENS_PER_SECOND = {"Qwen2_5_VLForConditionalGeneration": 4.0}   # transformers' vision_config default


@dataclass(frozen=True, slots=True)
class MultimodalConfig:
    image_token_id: int | None
    video_token_id: int | None
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    mask_policy: str = "causal"
    merge_size: int = 2   # a grid [t, h, w] of patches becomes t*h*w / merge_size**2 tokens
    tokens_per_second: float = 1.0   # multimodal RoPE: temporal positions a second of video spans
    image_spec: ImageSpec | None = None   # the vision tower's preprocessing, when fdplug runs the tower
    temporal_merge: int = 1   # a video's temporal patches per token row (ERNIE-4.5-VL merges 2)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], architecture: str = "") -> MultimodalConfig | None:
        image, video = raw.get("image_token_id"), raw.get("video_token_id")
        if image is None and video is None:
            return None
        policy = raw.get("fdplug_mm_mask_policy", "causal")
        if policy not in MASK_POLICIES:
            raise ModelLoadError(f"fdplug_mm_mask_policy {policy!r} in config.json is not one of {MASK_POLICIES}.",
                                 fix="set it to causal or bidirectional_items.")
        vision = raw.get("vision_config") or {}
        merge = int(vision.get("spatial_merge_size", 2))
        per_second = float(vision.get("tokens_per_second", TOKENS_PER_SECOND.get(architecture, 1.0)))
        start = raw.get("vision_start_token_id", raw.get("image_start_token_id"))   # (ERNIE-4.5-VL's names)
        end = raw.get("vision_end_token_id", raw.get("image_end_token_id"))
        temporal = int(vision.get("temporal_merge_size", 1))
        return cls(image, video, start, end, policy, merge, per_second, temporal_merge=temporal)

    def mrope_rule(self) -> MRopeRule:
        """Multimodal RoPE positions for this model's items; a video's temporal patch is taken to
        span one second (transformers' default without the processor's ``second_per_grid_ts``)."""
        from fdplug.core.multimodal.positions import MRopeRule

        return MRopeRule(self.merge_size, self.tokens_per_second, self.temporal_merge)

    def pad_token(self, modality: str) -> int:
        token = self.image_token_id if modality == "image" else self.video_token_id
        if token is None:
            raise InvalidRequestError(f"this model takes no {modality} inputs.", fix=f"remove the {modality} parts.")
        return token

    def num_tokens(self, modality: str, grid_thw: Sequence[int]) -> int:
        """Placeholder tokens of an item: t*h*w / merge² (a video's t / temporal_merge); h and w must be
        multiples of the merge size (t of the temporal merge)."""
        t, h, w = _grid(grid_thw)
        if h % self.merge_size or w % self.merge_size:
            raise InvalidRequestError(f"{modality} grid_thw {show_value(list(grid_thw))}: h and w must be multiples "
                                      f"of the spatial merge size {self.merge_size}.",
                                      fix="send the grid the encoder used.")
        if modality == "image" and t != 1:
            raise InvalidRequestError(f"image grid_thw {show_value(list(grid_thw))} must have t == 1.",
                                      fix="use [1, h, w].")
        if modality == "video" and t % self.temporal_merge:
            raise InvalidRequestError(f"video grid_thw {show_value(list(grid_thw))}: t must be a multiple of the "
                                      f"temporal merge size {self.temporal_merge}.", fix="send the grid the encoder "
                                      "used.")
        frames = t // self.temporal_merge if modality == "video" else t
        return frames * h * w // self.merge_size ** 2

    def span_length(self, modality: str, grid_thw: Sequence[int]) -> int:
        """Bidirectional span size: 0 (causal), the whole image, or one temporal row (2 frames) of a video.

        A video's grid ``t`` counts temporal patches of 2 frames each (Qwen2-VL's convention).
        """
        if self.mask_policy == "causal":
            return 0
        t, h, w = _grid(grid_thw)
        return self.num_tokens(modality, grid_thw) if modality == "image" else h * w // self.merge_size ** 2


def _grid(grid_thw: Sequence[int]) -> tuple[int, int, int]:
    if (not isinstance(grid_thw, (list, tuple)) or len(grid_thw) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in grid_thw)):
        raise InvalidRequestError(f"grid_thw must be three positive integers [t, h, w], got {show_value(grid_thw)}.",
                                  fix="send the feature's grid as [t, h, w].")
    return grid_thw[0], grid_thw[1], grid_thw[2]
