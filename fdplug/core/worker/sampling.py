"""Glue between the InputBatch's per-slot sampling fields and the sampler (temporary: greedy only)."""

from __future__ import annotations

from typing import Any

import numpy as np


class SamplingState:
    def __init__(self, max_num_seqs: int, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size

    def sample(self, logits: Any, batch: Any, slots: np.ndarray) -> tuple[np.ndarray, list]:
        import paddle

        return paddle.argmax(logits, axis=-1).numpy().astype(np.int64), [None] * len(slots)
