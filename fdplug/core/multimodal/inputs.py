"""A request's multimodal items (pre-encoded features, or pictures), and their placeholder tokens.

A picture (an ``image_url`` part, or a PIL image offline) is an item holding its encoded bytes,
which the engine's vision encoder turns into features (`pictures`). A feature item arrives as
``{"url": ..., "grid_thw": [t, h, w], "uuid": optional}``; a video stored as one object per frame
group gives ``"urls": [...]`` instead (their rows are concatenated in order, and they download in
parallel). The prompt holds one pad token per item (the chat template puts it there);
``expand_placeholders`` widens each into the item's token count and records where it sits, so the
features' rows land on exactly those tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fdplug.core.multimodal.config import MultimodalConfig
from fdplug.core.multimodal.pictures import UrlFetcher, image_url_bytes, picture_hash, pil_bytes
from fdplug.errors import InvalidRequestError, show_value
from fdplug.plugin_api.scheduled_work import MMPlaceholder

MODALITIES = ("image", "video")


@dataclass(frozen=True, slots=True)
class MMFeatureInput:
    """One item to fetch (``urls``) or to encode (``data``, a picture's bytes). ``mm_hash`` is known up
    front when the client gave a ``uuid``, and for a picture (its bytes' hash)."""

    modality: str
    urls: tuple[str, ...]
    grid_thw: tuple[int, int, int]
    num_tokens: int
    mm_hash: str | None = None
    data: bytes = b""

    @classmethod
    def picture(cls, data: bytes, name: str, mm_config: MultimodalConfig) -> MMFeatureInput:
        """A picture's item, its grid from the header (nothing is decoded here), for a model whose
        tower runs here (`check_pictures`, which the collector asks before it fetches anything)."""
        from fdplug.core.vision.image_processing import probe  # (numpy: only once a picture comes)

        grid = mm_config.image_spec.grid(*probe(data, name))
        return cls("image", (), grid, mm_config.num_tokens("image", grid), picture_hash(data), data)

    @classmethod
    def parse(cls, modality: str, part: Any, mm_config: MultimodalConfig, tenant: str = "") -> MMFeatureInput:
        if modality not in MODALITIES:
            raise InvalidRequestError(f"unknown modality {modality!r}.", fix="use image or video.")
        urls = _urls(modality, part)
        grid = part.get("grid_thw")
        num_tokens = mm_config.num_tokens(modality, grid)
        if len(urls) > num_tokens:   # every piece holds at least one row
            raise InvalidRequestError(f"a {modality}_feature has {len(urls)} urls for {num_tokens} placeholder tokens.",
                                      fix="send at most one piece per feature row (grid_thw t*h*w/4 of them).",
                                      param="messages")
        uuid = part.get("uuid")
        if uuid is not None and (not isinstance(uuid, str) or not uuid):
            raise InvalidRequestError("uuid must be a non-empty string.", fix="leave it out or send a string.")
        return cls(modality, urls, tuple(grid), num_tokens, uuid_hash(tenant, uuid) if uuid else None)


def check_pictures(mm_config: MultimodalConfig, name: str) -> None:
    """A 400 for a picture sent to a model whose vision tower fdplug does not run."""
    if mm_config.image_spec is None:
        raise InvalidRequestError(f"{name}: this model's vision tower does not run here, so it takes "
                                  "pre-encoded features, not pictures.", fix="send an image_feature part.",
                                  param="messages")


def _urls(modality: str, part: Any) -> tuple[str, ...]:
    fix = 'send {"url": "bos://bucket/key.npy", "grid_thw": [t, h, w]} (or "urls": [...] for a video in pieces).'
    if not isinstance(part, Mapping):
        raise InvalidRequestError(f"a {modality}_feature must be an object.", fix=fix)
    urls = part.get("urls", [part.get("url")] if "url" in part else None)
    if not isinstance(urls, list) or not urls or not all(isinstance(u, str) and u for u in urls):
        raise InvalidRequestError(f"a {modality}_feature needs a 'url' string or a non-empty 'urls' list.", fix=fix)
    return tuple(urls)


def uuid_hash(tenant: str, uuid: str) -> str:
    """A client's item id, scoped by tenant (API key): one tenant cannot poison another's cache."""
    return "u:" + hashlib.sha256(f"{tenant}\0{uuid}".encode()).hexdigest()


def content_hash(blobs: Sequence[bytes]) -> str:
    digest = hashlib.sha256()
    for blob in blobs:
        digest.update(hashlib.sha256(blob).digest())
    return "c:" + digest.hexdigest()


def expand_placeholders(token_ids: Sequence[int], items: Sequence[MMFeatureInput], mm_config: MultimodalConfig,
                        max_model_len: int) -> tuple[list[int], list[MMPlaceholder]]:
    """Widen each item's single pad token into its ``num_tokens`` copies, in order of appearance.

    The widened length is computed from the numbers and checked against ``max_model_len`` first: a
    200-byte request with a grid of 2^64 patches is a 400, not an allocation per token.
    Placeholders carry an empty ``mm_hash`` until the item's identity is known (uuid or content).
    """
    pads = {mm_config.pad_token(m) for m in {i.modality for i in items}} if items else set()
    found = [i for i, t in enumerate(token_ids) if t in pads]
    if len(found) != len(items):
        raise InvalidRequestError(f"the prompt has {len(found)} multimodal placeholder(s) but {len(items)} "
                                  f"item(s) were given.", fix="send one placeholder per image/video item.")
    total = len(token_ids) - len(items) + sum(item.num_tokens for item in items)
    if total >= max_model_len:
        sizes = ", ".join(show_value(item.num_tokens) for item in items[:8]) + (", ..." if len(items) > 8 else "")
        raise InvalidRequestError(    # show_value: a product of 4,000-digit grids has no str() (a ValueError)
            f"the prompt would have {show_value(total)} tokens with its multimodal items ({sizes} placeholder "
            f"tokens, from their grid_thw), but max_model_len is {max_model_len}.",
            fix="send smaller images/videos (grid_thw), fewer of them, or start the engine with a larger "
                "max_model_len.", param="messages")
    out: list[int] = []
    positions: list[MMPlaceholder] = []
    last = 0
    for index, item in zip(found, items):
        if token_ids[index] != mm_config.pad_token(item.modality):
            raise InvalidRequestError(f"placeholder {len(positions)} is not a {item.modality} placeholder.",
                                      fix="keep the items in the order of their placeholders.")
        out.extend(token_ids[last:index])
        span = mm_config.span_length(item.modality, item.grid_thw)
        positions.append(MMPlaceholder(len(out), item.num_tokens, item.mm_hash or "", span, item.grid_thw,
                                       item.modality))
        out.extend([token_ids[index]] * item.num_tokens)
        last = index + 1
    out.extend(token_ids[last:])
    return out, positions


PART_TYPES = {"image_feature": "image", "video_feature": "video", "image_url": "image", "image_pil": "image"}


class FeaturePartCollector:
    """A chat ``ContentPartHandler``: records each multimodal part and returns its placeholder text.

    ``{"type": "image_feature", "image_feature": {"url", "grid_thw", "uuid"?}}`` (and
    ``video_feature``), ``{"type": "image_url", "image_url": {"url": "data:..." | "https://..."}}`` and
    (offline) ``{"type": "image_pil", "image_pil": <PIL image>}`` become
    ``<|vision_start|><|image_pad|><|vision_end|>`` (the model's own tokens), which
    ``expand_placeholders`` later widens to the item's token count. ``fetch`` reads http(s) image
    URLs (None: refused). ``parts`` holds the parsed items, which `InputProcessor.process` takes
    as they are (a picture is fetched and probed once).
    """

    def __init__(self, mm_config: MultimodalConfig | None, tokenizer: Any, tenant: str = "",
                 fetch: UrlFetcher | None = None) -> None:
        self.mm_config = mm_config
        self.tokenizer = tokenizer
        self.tenant = tenant
        self.fetch = fetch
        self.items: list[MMFeatureInput] = []
        self.parts: list[MMFeatureInput] = []

    def __call__(self, part: Mapping[str, Any] | MMFeatureInput, message_index: int) -> str:
        item = part if isinstance(part, MMFeatureInput) else self._parse(part, message_index)
        self.items.append(item)
        self.parts.append(item)
        return self.placeholder(item.modality)

    def _parse(self, part: Mapping[str, Any], message_index: int) -> MMFeatureInput:
        kind = part.get("type")
        if kind not in PART_TYPES:
            raise InvalidRequestError(f"message {message_index}: content part type {kind!r} is not supported.",
                                      fix="use text, image_url, image_feature or video_feature parts.")
        name = f"{kind} item {len(self.items)} (message {message_index})"
        if self.mm_config is None:
            raise InvalidRequestError(f"this model takes no multimodal inputs (message {message_index} has a "
                                      f"{kind} part).", fix="send text only, or serve a multimodal model.")
        given = [key for key in PART_TYPES if key in part]
        if len(given) > 1:
            raise InvalidRequestError(f"{name} gives {' and '.join(given)}: a part is one item, "
                                      f"given once as its {kind}.", fix="send pixels and features as separate "
                                      "parts, each with the payload its type names.", param="messages")
        if kind in ("image_url", "image_pil"):
            check_pictures(self.mm_config, name)
        if kind == "image_url":
            return MMFeatureInput.picture(image_url_bytes(part[kind], name, self.fetch), name, self.mm_config)
        if kind == "image_pil":
            return MMFeatureInput.picture(pil_bytes(part[kind], name), name, self.mm_config)
        return MMFeatureInput.parse(PART_TYPES[kind], part.get(kind), self.mm_config, self.tenant)

    def placeholder(self, modality: str) -> str:
        cfg = self.mm_config
        ids = [cfg.vision_start_token_id, cfg.pad_token(modality), cfg.vision_end_token_id]
        return "".join(self.tokenizer.id_to_token(i) for i in ids if i is not None)
