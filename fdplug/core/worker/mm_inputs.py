"""A step's multimodal inputs: the mask offsets of bidirectional items, and the feature rows that
replace their placeholders' embeddings."""

from __future__ import annotations

from typing import Any

import numpy as np

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
