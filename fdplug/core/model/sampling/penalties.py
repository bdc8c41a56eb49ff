"""Repetition, frequency and presence penalties, and the per-slot token table they read.

Penalties touch only the tokens a request has seen (sparse), not the vocabulary: the caller keeps one
row of distinct ids and output counts per slot (``penalty_tokens`` on add, ``record_tokens`` per
step), so the bookkeeping is O(tokens), not O(vocab), per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fdplug.plugin_api.paddle import import_paddle

if TYPE_CHECKING:
    from fdplug.core.model.sampling.metadata import SamplingMetadata

paddle = import_paddle()


def penalty_tokens(prompt_ids, output_ids=()) -> tuple[np.ndarray, np.ndarray]:
    """A slot's distinct ids and output counts when a request is added (or resumed after
    preemption); pad them to the table width with -1 / 0."""
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    output = np.asarray(output_ids, dtype=np.int64)
    ids = np.unique(np.concatenate([prompt, output]))
    counts = np.zeros(ids.shape, np.int32)
    if output.size:
        out_ids, out_counts = np.unique(output, return_counts=True)
        counts[np.searchsorted(ids, out_ids)] = out_counts
    return ids, counts


def record_tokens(ids: np.ndarray, counts: np.ndarray, num_ids: np.ndarray, slots: np.ndarray,
                  tokens: np.ndarray) -> None:
    """Count one new output token per slot, in place and vectorised over slots.

    ``ids`` / ``counts`` are [slots, L] with ``num_ids`` entries in use per slot. L >= max_model_len
    cannot overflow: a sequence has no more distinct tokens than tokens.
    """
    hit = ids[slots, :max(int(num_ids[slots].max(initial=0)), 1)] == tokens[:, None]
    found = hit.any(axis=1)
    col = np.where(found, hit.argmax(axis=1), num_ids[slots])
    if (col >= ids.shape[1]).any():
        raise ValueError("penalty token table is full; make it max_model_len wide")
    ids[slots, col] = tokens
    counts[slots, col] += 1
    num_ids[slots] += ~found


def apply_penalties(logits, meta: SamplingMetadata, inplace: bool = False):
    """Repetition (prompt and output: positive logits / p, the rest * p), then ``- freq * count``
    and ``- presence * (count > 0)``. Touches only the listed tokens: one gather, one scatter (a
    copy of ``logits`` unless ``inplace``)."""
    if meta.no_penalties:
        return logits
    num_reqs, vocab = logits.shape
    ids = meta.penalty_token_ids
    counts = meta.penalty_token_counts
    valid = (ids >= 0) & meta.penalised()[:, None]
    rows = np.nonzero(valid)[0]
    if rows.size == 0:
        return logits
    idx = paddle.to_tensor(rows * vocab + ids[valid])
    cnt = counts[valid].astype(np.float32) if counts is not None else np.zeros(rows.size, np.float32)
    rep = paddle.to_tensor(meta.repetition_penalty[rows])
    flat = logits.reshape([-1])
    vals = paddle.gather(flat, idx)
    vals = (paddle.where(vals > 0, vals / rep, vals * rep) - paddle.to_tensor(meta.frequency_penalty[rows] * cnt)
            - paddle.to_tensor(meta.presence_penalty[rows] * (cnt > 0)))
    if inplace:
        flat.scatter_(idx, vals, overwrite=True)
        return logits
    return paddle.scatter(flat, idx, vals, overwrite=True).reshape([num_reqs, vocab])
