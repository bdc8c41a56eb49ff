"""A step's multimodal inputs: the mask offsets of bidirectional items, and the feature rows that
replace their placeholders' embeddings."""

from __future__ import annotations

from typing import Any

import numpy as np

from fdplug.core.multimodal.positions import MRopeRule
from fdplug.errors import RequestStepError
from fdplug.plugin_api.scheduled_work import SchedulerOutput


def span_offsets(items: list) -> np.ndarray:
    """Mask spec of bidirectional items: each token sees up to the end of its span (0: causal)."""
    offsets = np.zeros(max(item.end for item in items), dtype=np.int64)
    for item in items:
        pos = np.arange(item.offset, item.end)
        span_end = np.minimum(item.offset + ((pos - item.offset) // item.span_length + 1) * item.span_length,
                              item.end)
        offsets[pos] = span_end - (pos + 1)
    return offsets


def mm_embeddings(batch: Any, hidden_size: int, so: SchedulerOutput, slots: np.ndarray, start: np.ndarray,
                  query_start: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Token rows of this step that fall on multimodal items, and the feature rows that go there."""
    rows, values = [], []
    for i, slot in enumerate(slots):
        lo, hi = start[i], start[i] + query_start[i + 1] - query_start[i]
        for item in batch.mm_positions[slot]:
            a, b = max(lo, item.offset), min(hi, item.end)
            if a < b:
                features = so.mm_features.get(item.mm_hash)
                if features is None or features.shape != (item.length, hidden_size):
                    raise RequestStepError([batch.req_id[slot]], f"the features of item {item.mm_hash} are "
                                           f"{None if features is None else features.shape}, not "
                                           f"({item.length}, {hidden_size})")
                rows.append(np.arange(a, b) - lo + query_start[i])
                values.append(features[a - item.offset:b - item.offset])
    if not rows:
        return None, None
    return np.concatenate(rows), np.concatenate(values)


def item_slot_values(rule: MRopeRule | None, items: tuple) -> dict[str, int]:
    """A new request's ``items_end`` and (multimodal RoPE) ``rope_delta`` slot values
    (`mrope_positions`, `modality_rows`)."""
    values = {"items_end": max((item.end for item in items), default=0)}
    if rule is not None:
        values["rope_delta"] = rule.position_delta([item for item in items if item.grid_thw])
    return values


def mrope_positions(batch: Any, rule: MRopeRule, positions: np.ndarray, token_slots: np.ndarray,
                    num_positions: int) -> np.ndarray:
    """``[3, T]`` multimodal RoPE positions of a step's tokens: past its items a token sits at index +
    ``rope_delta`` (every decode token: one add); a token before the end of its request's last item
    (a prefill) is placed by the items (`MRopeRule.positions`). A request whose positions would run
    past the RoPE tables (a long video's time spacing) fails alone."""
    out = np.broadcast_to(positions + batch.rope_delta[token_slots], (3, len(positions))).copy()
    placed = positions < batch.items_end[token_slots]
    for slot in np.unique(token_slots[placed]):
        rows = placed & (token_slots == slot)
        out[:, rows] = rule.positions(positions[rows], batch.mm_positions[slot])
    if len(positions) and int(out.max()) >= num_positions:
        slots = np.unique(token_slots[(out >= num_positions).any(axis=0)])
        raise RequestStepError([batch.req_id[s] for s in slots], f"multimodal RoPE positions reach "
                               f"{int(out.max())}, past the {num_positions} the model's tables hold")
    return out


def modality_rows(batch: Any, mm: Any, slots: np.ndarray, start: np.ndarray,
                  query_start: np.ndarray) -> tuple[np.ndarray | None, np.ndarray] | None:
    """The text and the vision rows of a step, for modality experts (ERNIE-4.5-VL): an item's tokens
    and the start and end tokens around it are vision, as its processor marks them; None: no
    vision row this step."""
    vision = []
    for i in np.flatnonzero(start <= batch.items_end[slots]):   # (a decode token is past every item)
        slot = slots[i]
        lo, hi = int(start[i]), int(start[i] + query_start[i + 1] - query_start[i])
        tokens = batch.token_ids[slot]
        for item in batch.mm_positions[slot]:
            first = item.offset - (item.offset > 0 and tokens[item.offset - 1] == mm.vision_start_token_id)
            end = item.end + (tokens[item.end] == mm.vision_end_token_id)
            a, b = max(lo, first), min(hi, end)
            if a < b:
                vision.append(np.arange(a, b) - lo + query_start[i])
    if not vision:
        return None
    rows = np.concatenate(vision)
    text = np.setdiff1d(np.arange(int(query_start[-1])), rows)
    return (text if len(text) else None), rows
