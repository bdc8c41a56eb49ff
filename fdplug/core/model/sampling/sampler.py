"""Turning one row of logits per request into one token per request (vLLM semantics).

Per row: penalties (penalties.py) -> greedy argmax (temperature < 1e-5) or temperature -> min_p ->
top_k -> top_p, folded into one threshold per row (sampling_filters.py) -> draw.

The draw is an inverse CDF with one uniform per row. A seeded row's uniform is a hash of
(seed, step), ``step`` being how many tokens the request has generated, so its tokens depend neither
on the batch, its row, nor preemption. Every choice of path (window width, window or full-vocab draw)
is made from the row alone, so a row takes the same path in any batch.

Logprobs are vLLM's default ``raw_logprobs``: log_softmax of the model's logits, before penalties,
temperature and filters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fdplug.core.model.sampling.filters import Cut, cut_for, pick_cols, row_topk, take_rows
from fdplug.core.model.sampling.metadata import SamplingMetadata
from fdplug.core.model.sampling.penalties import apply_penalties
from fdplug.plugin_api.paddle import import_paddle

paddle = import_paddle()

@dataclass(slots=True)
class SamplerOutput:
    """Sampled tokens, and raw-distribution logprobs for every row when any row asked (else None).

    A row that asked for N top logprobs reads ``top_*[i, :N]``.
    """

    sampled_token_ids: np.ndarray               # int64 [n]
    sampled_logprobs: np.ndarray | None = None  # float32 [n]
    sampled_ranks: np.ndarray | None = None     # int64 [n]: tokens with logprob >= the sampled one's
    top_token_ids: np.ndarray | None = None     # int64 [n, max N], best first, ties by lower id
    top_logprobs: np.ndarray | None = None      # float32 [n, max N]


# ------------------------------------------------------------------------------------------------
# random draws
# ------------------------------------------------------------------------------------------------


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijective 64-bit hash with full avalanche."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seeded_uniforms(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Uniforms in (0, 1] that depend only on (seed, step): a counter-based generator, so no state
    has to follow a request through preemption, swaps or condensing."""
    golden = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        h = _mix64(np.asarray(seeds).astype(np.uint64) + golden)
        h = _mix64(h ^ (np.asarray(steps).astype(np.uint64) * golden + np.uint64(1)))
    return ((h >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53


def _draw_window(cut: Cut, rows: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse CDF over a row's kept window in token-id order (canonical, whatever topk's tie order)."""
    vals, ids = cut.vals[rows], cut.ids[rows]
    outside = (np.arange(vals.shape[1]) >= cut.width[rows, None]) | (vals < cut.thresh[rows, None])
    ids = np.where(outside, np.iinfo(np.int64).max, ids)
    order = np.argsort(ids, axis=1, kind="stable")
    mass = np.where(outside, 0.0, np.exp(vals - vals[:, :1]))
    cdf = np.cumsum(np.take_along_axis(mass, order, axis=1), axis=1, dtype=np.float64)
    pos = (cdf < (u * cdf[:, -1])[:, None]).sum(axis=1)
    return np.take_along_axis(ids, order, axis=1)[np.arange(len(rows)), pos]


def _draw_full(cut: Cut, sel: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse CDF over the whole vocabulary in id order, for positions ``sel`` of ``cut.full``."""
    probs, thresh = take_rows(cut.probs, sel), cut.thresh[cut.full[sel]]
    if (thresh > cut.masked[sel]).any():   # top_p raised the cut since ``probs`` was masked
        probs = paddle.masked_fill(probs, take_rows(cut.scaled, sel) < paddle.to_tensor(thresh[:, None]), 0.0)
    cdf = paddle.cumsum(probs, axis=1)
    total = cdf[:, -1].contiguous().numpy().astype(np.float64)
    target = np.minimum(u * total, total).astype(np.float32)   # > 0, so never a zero-mass token
    return paddle.searchsorted(cdf, paddle.to_tensor(target[:, None])).numpy()[:, 0]


# ------------------------------------------------------------------------------------------------
# the sampler
# ------------------------------------------------------------------------------------------------


class Sampler:
    """Stateless apart from the generator of unseeded rows; call once per step."""

    def __init__(self, seed: int | None = None, argmax: Callable[[Any], np.ndarray] | None = None) -> None:
        """``argmax``: the selected ``argmax`` op (`fdplug.plugin_api.ops`; default: the portable one)."""
        from fdplug.core.portable.ops import argmax as portable

        self._rng = np.random.default_rng(seed)
        self._argmax = argmax or portable

    def __call__(self, logits, meta: SamplingMetadata) -> SamplerOutput:
        """``logits``: fp32 paddle [num_reqs, vocab], one row per request sampling this step.
        Penalties are applied to ``logits`` in place unless a row asked for (raw) logprobs."""
        wants_logprobs = meta.max_num_logprobs >= 0
        processed = apply_penalties(logits, meta, inplace=not wants_logprobs)
        if meta.all_random:
            tokens = self._sample_random(processed, meta)
        else:
            tokens = self._argmax(processed)
            if not meta.all_greedy:
                rand = np.nonzero(~meta.greedy)[0]
                tokens[rand] = self._sample_random(take_rows(processed, rand), meta.rows(rand))
        out = SamplerOutput(tokens)
        if wants_logprobs:
            _logprobs(logits, tokens, meta.max_num_logprobs, out)
        return out

    def process_logits(self, logits, meta: SamplingMetadata):
        """What each row is drawn from: penalised logits, and for random rows scaled by
        1/temperature with -inf outside the kept set. For tests and debugging (extra full passes)."""
        processed = apply_penalties(logits, meta)
        rand = np.nonzero(~meta.greedy)[0]
        if rand.size == 0:
            return processed
        sub, sub_meta = take_rows(processed, rand), meta.rows(rand)
        thresh = cut_for(sub, sub_meta).thresh
        scaled = sub * paddle.to_tensor((1.0 / sub_meta.temperature).astype(np.float32)[:, None])
        kept = paddle.masked_fill(scaled, scaled < paddle.to_tensor(thresh[:, None]), float("-inf"))
        return paddle.scatter(processed, paddle.to_tensor(rand), kept, overwrite=True)

    def _sample_random(self, logits, meta: SamplingMetadata) -> np.ndarray:
        cut = cut_for(logits, meta)
        u = 1.0 - self._rng.random(len(meta.seeded))   # (0, 1]
        if meta.seeded.any():
            u[meta.seeded] = seeded_uniforms(meta.seeds[meta.seeded], meta.steps[meta.seeded])
        tokens = np.empty(len(u), np.int64)
        win = np.nonzero(cut.bounded)[0]
        if win.size:
            tokens[win] = _draw_window(cut, win, u[win])
        sel = np.nonzero(~cut.bounded[cut.full])[0]
        if sel.size:
            tokens[cut.full[sel]] = _draw_full(cut, sel, u[cut.full[sel]])
        return tokens


def _logprobs(logits, tokens: np.ndarray, num_top: int, out: SamplerOutput) -> None:
    """Raw-distribution logprobs, every row. lse is read off a softmax (max p = 1 / sum exp(x - max)):
    Paddle's CPU log_softmax takes seconds and its logsumexp is slower than this."""
    row_max = logits.max(axis=1).numpy()
    lse = row_max - np.log(paddle.nn.functional.softmax(logits, axis=1).max(axis=1).numpy())
    picked = pick_cols(logits, tokens[:, None])
    ge = logits >= paddle.to_tensor(picked)
    out.sampled_ranks = ge.astype("float32").sum(axis=1).numpy().astype(np.int64)
    out.sampled_logprobs = (picked[:, 0] - lse).astype(np.float32)
    ids, vals = np.zeros((len(tokens), 0), np.int64), np.zeros((len(tokens), 0), np.float32)
    if num_top > 0:
        vals, ids = row_topk(logits, num_top)
        order = np.lexsort((ids, -vals), axis=1)   # ties: lower id first
        vals, ids = np.take_along_axis(vals, order, 1), np.take_along_axis(ids, order, 1)
    out.top_token_ids = ids
    out.top_logprobs = (vals - lse[:, None]).astype(np.float32)
