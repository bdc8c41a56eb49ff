"""Turning one row of logits per request into one token per request (vLLM semantics).

Per row: penalties -> greedy argmax (temperature < 1e-5) or temperature -> min_p -> top_k -> top_p
-> draw. Each filter keeps the tokens whose scaled logit is at or above a cut, so the three fold into
**one threshold per row**, and tokens tied at a boundary are all kept (vLLM keeps an arbitrary subset
of a top_p tie). Cuts are found on a small sorted window (a top-k) rather than a full sort (Paddle's
CPU sort of [64, 151936] takes ~1 s); a full sort is only the fallback for a top_p nucleus wider than
the window. Penalties touch only the tokens a request has seen (sparse), not the vocabulary.

The draw is an inverse CDF with one uniform per row. A seeded row's uniform is a hash of
(seed, step), ``step`` being how many tokens the request has generated, so its tokens depend neither
on the batch, its row, nor preemption. Every choice of path (window width, window or full-vocab draw)
is made from the row alone, so a row takes the same path in any batch.

Logprobs are vLLM's default ``raw_logprobs``: log_softmax of the model's logits, before penalties,
temperature and filters.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from fdplug.plugin_api.paddle import import_paddle

paddle = import_paddle()

SAMPLING_EPS = 1e-5   # temperature below this is greedy (vLLM's _SAMPLING_EPS)
MAX_NUM_LOGPROBS = 20
TOP_P_WINDOW = 1024   # sorted candidates searched for a top_p / min_p cut before a full sort


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling state; row i of every array belongs to logits row i.

    Penalty tokens are sparse: ``penalty_token_ids[i]`` lists the distinct ids of row i's prompt and
    output (padding -1), ``penalty_token_counts[i]`` how often each occurs in the output (0: prompt
    only). Repetition applies to every listed id, frequency to the count, presence to ``count > 0``.
    Build a slot's row with ``penalty_tokens`` and update it with ``record_tokens``: O(tokens), not
    O(vocab), per step.
    """

    temperature: np.ndarray          # float32 [n]; < SAMPLING_EPS: greedy
    top_k: np.ndarray                # int64 [n]; <= 0 or >= vocab: off
    top_p: np.ndarray                # float32 [n] in (0, 1]; 1: off
    min_p: np.ndarray                # float32 [n] in [0, 1]; 0: off
    presence_penalty: np.ndarray     # float32 [n]; 0: off
    frequency_penalty: np.ndarray    # float32 [n]; 0: off
    repetition_penalty: np.ndarray   # float32 [n]; 1: off
    seeds: np.ndarray                # int64 or uint64 [n]; read where ``seeded``
    seeded: np.ndarray               # bool [n]
    steps: np.ndarray                # int64 [n]: output tokens the request had before this one
    num_logprobs: np.ndarray         # int64 [n]; -1: none, 0: sampled token only, N: and the top N
    penalty_token_ids: np.ndarray | None = None      # int64 [n, L], padded with -1
    penalty_token_counts: np.ndarray | None = None   # int32 [n, L]
    greedy: np.ndarray = field(init=False)
    all_greedy: bool = field(init=False)
    all_random: bool = field(init=False)
    no_penalties: bool = field(init=False)
    max_num_logprobs: int = field(init=False)

    def __post_init__(self) -> None:
        self.greedy = self.temperature < SAMPLING_EPS
        self.all_greedy = bool(self.greedy.all())
        self.all_random = not self.greedy.any()
        self.no_penalties = self.penalty_token_ids is None or not self.penalised().any()
        self.max_num_logprobs = min(int(self.num_logprobs.max(initial=-1)), MAX_NUM_LOGPROBS)

    def penalised(self) -> np.ndarray:
        """Rows with any penalty switched on."""
        return ((self.repetition_penalty != 1) | (self.frequency_penalty != 0)
                | (self.presence_penalty != 0))

    @classmethod
    def make(cls, num_reqs: int, **values) -> SamplingMetadata:
        """Defaults (temperature 1, no filter, penalty, seed or logprobs) overridden by ``values``;
        scalars broadcast to every row."""
        defaults = dict(temperature=(1.0, np.float32), top_k=(0, np.int64), top_p=(1.0, np.float32),
                        min_p=(0.0, np.float32), presence_penalty=(0.0, np.float32),
                        frequency_penalty=(0.0, np.float32), repetition_penalty=(1.0, np.float32),
                        seeds=(0, np.int64), seeded=(False, np.bool_), steps=(0, np.int64),
                        num_logprobs=(-1, np.int64))
        for name, (default, dtype) in defaults.items():
            value = np.asarray(values.get(name, default), dtype=dtype)
            values[name] = np.broadcast_to(value, (num_reqs,)).copy()
        return cls(**values)

    def rows(self, idx: np.ndarray) -> SamplingMetadata:
        """The metadata of some rows, in ``idx`` order."""
        return SamplingMetadata(**{f.name: None if (v := getattr(self, f.name)) is None else v[idx]
                                   for f in fields(self) if f.init})


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
# penalty state: one row per slot, kept by the caller
# ------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------
# min_p, top_k, top_p as one threshold
# ------------------------------------------------------------------------------------------------


def _take(x, rows: np.ndarray):
    """Rows of a paddle tensor, without a copy when that is all of them."""
    return x if rows.size == x.shape[0] else paddle.index_select(x, paddle.to_tensor(rows))


def _pick(x, cols: np.ndarray) -> np.ndarray:
    """x[i, cols[i, j]] as numpy: a flat gather (take_along_axis copies all of x on CPU)."""
    flat = np.arange(cols.shape[0])[:, None] * x.shape[1] + cols
    return paddle.gather(x.reshape([-1]), paddle.to_tensor(flat.reshape(-1))).numpy().reshape(cols.shape)


def _on_cpu(x) -> bool:
    """Whether numpy may read ``x`` in place (dlpack) for a kernel Paddle's CPU build does slowly."""
    return x.place.is_cpu_place()


def _topk(x, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest values per row, descending, and their ids. On CPU numpy's argpartition (zero-copy
    through dlpack) is ~3x faster than Paddle's topk; which of several ids tied at the k-th place
    come back may differ, and no result here depends on it."""
    if not _on_cpu(x):
        top = paddle.topk(x, k, axis=1)
        return top[0].numpy(), top[1].numpy()
    a = np.from_dlpack(x)
    ids = np.argpartition(a, a.shape[1] - k, axis=1)[:, a.shape[1] - k:]
    vals = np.take_along_axis(a, ids, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    return np.take_along_axis(vals, order, axis=1), np.take_along_axis(ids, order, axis=1)


def _sorted_desc(x) -> np.ndarray:
    """A full descending sort of values: numpy's on CPU, ~15x faster than Paddle's CPU kernel."""
    if _on_cpu(x):
        return -np.sort(-np.from_dlpack(x), axis=1)
    return paddle.sort(x, axis=1, descending=True).numpy()


def _nucleus_cut(vals, mass, top_p, width, total=None) -> np.ndarray:
    """The value ``vals[j]`` at the first j where the running ``mass`` (best first) reaches
    ``top_p * total`` (default: the window's own mass); NaN where the window ends first."""
    mass = np.where(np.arange(vals.shape[1]) < width[:, None], mass, 0)
    cum = np.cumsum(mass, axis=1, dtype=np.float64)
    total = cum[:, -1] if total is None else total
    j = (cum < (top_p * total)[:, None]).sum(axis=1)
    return np.where(j < width, vals[np.arange(len(j)), np.minimum(j, vals.shape[1] - 1)], np.nan)


@dataclass(slots=True)
class _Cut:
    """Random rows' filters as one threshold on scaled logits, and where each row is drawn from.

    A ``bounded`` row keeps only tokens of its own window (``width`` = top_k + 1 or TOP_P_WINDOW) and
    is drawn on the host from ``vals``/``ids``; the other rows, all in ``full``, from ``probs``.
    """

    thresh: np.ndarray   # float32 [r]
    vals: np.ndarray     # float32 [r, K]: scaled logits, descending
    ids: np.ndarray      # int64 [r, K]
    width: np.ndarray    # int64 [r]
    last: np.ndarray     # float32 [r]: vals at width - 1
    bounded: np.ndarray  # bool [r]
    full: np.ndarray     # rows not bounded before top_p (a superset of ~bounded)
    scaled: object = None   # paddle [len(full), V]: logits / temperature
    probs: object = None    # paddle [len(full), V]: softmax of ``scaled``, 0 below ``masked``
    masked: np.ndarray | None = None   # float32 [len(full)]: the threshold ``probs`` is masked at

    def rebound(self, vocab: int) -> None:
        """A row is bounded when its window holds the whole vocabulary or its threshold lies above
        the window's last value (so every kept token is inside)."""
        self.bounded = (self.width == vocab) | ((self.width > 0) & (self.thresh > self.last))


def _cut(logits, meta: SamplingMetadata) -> _Cut:
    """Temperature, min_p, top_k and top_p of random rows as one threshold per row."""
    num_reqs, vocab = logits.shape
    rows = np.arange(num_reqs)
    inv_t = (1.0 / meta.temperature).astype(np.float32)
    k_on = (meta.top_k > 0) & (meta.top_k < vocab)
    p_on, mp_on = meta.top_p < 1, meta.min_p > 0
    width = np.where(k_on, np.minimum(meta.top_k + 1, vocab), np.where(p_on | mp_on, min(TOP_P_WINDOW, vocab), 0))
    vals, ids = np.zeros((num_reqs, 1), np.float32), np.zeros((num_reqs, 1), np.int64)
    if width.any():   # topk before scaling: same order, and only the window gets scaled
        vals, ids = _topk(logits, int(width.max()))
        vals = vals * inv_t[:, None]
    thresh = np.full(num_reqs, -np.inf, np.float32)
    if mp_on.any():   # p >= min_p * p_max  <=>  s >= s_max + log(min_p)
        with np.errstate(divide="ignore"):
            thresh = np.where(mp_on, vals[:, 0] + np.log(meta.min_p), thresh).astype(np.float32)
    if k_on.any():
        kth = vals[rows, np.clip(meta.top_k - 1, 0, vals.shape[1] - 1)]
        thresh = np.where(k_on, np.maximum(thresh, kth), thresh)
    cut = _Cut(thresh, vals, ids, width, vals[rows, np.maximum(width - 1, 0)], None, None)
    cut.rebound(vocab)
    cut.full = np.nonzero(~cut.bounded)[0]
    if cut.full.size:
        _full_probs(cut, logits, inv_t)
    if p_on.any():
        _top_p(cut, meta.top_p, vocab)
    return cut


def _full_probs(cut: _Cut, logits, inv_t: np.ndarray) -> None:
    """Softmax over the vocabulary for rows not bounded to a window, masked at their threshold."""
    cut.scaled = _take(logits, cut.full)
    if (inv_t[cut.full] != 1).any():
        cut.scaled = cut.scaled * paddle.to_tensor(inv_t[cut.full, None])
    cut.probs = paddle.nn.functional.softmax(cut.scaled, axis=1)
    cut.masked = cut.thresh[cut.full]
    if np.isfinite(cut.masked).any():
        cut.probs = paddle.masked_fill(cut.probs, cut.scaled < paddle.to_tensor(cut.masked[:, None]), 0.0)


def _top_p(cut: _Cut, top_p: np.ndarray, vocab: int) -> None:
    """Raise each top_p row's threshold to its nucleus: from the window when the kept set fits in it,
    else with the full row's mass, sorting the row fully only when the window is too narrow."""
    p_on = top_p < 1
    nucleus = np.full(len(top_p), np.nan, np.float32)
    win = np.nonzero(p_on & cut.bounded)[0]
    if win.size:
        vals = cut.vals[win]
        mass = np.exp(vals - vals[:, :1]) * (vals >= cut.thresh[win, None])
        nucleus[win] = _nucleus_cut(vals, mass, top_p[win], cut.width[win])
    sel = np.nonzero(p_on[cut.full])[0]   # positions in ``full``
    if sel.size:
        rows = cut.full[sel]
        probs = _take(cut.probs, sel)
        total = probs.sum(axis=1).numpy().astype(np.float64)
        nucleus[rows] = _nucleus_cut(cut.vals[rows], _pick(probs, cut.ids[rows]), top_p[rows], cut.width[rows],
                                     total)
        wide = np.isnan(nucleus[rows])
        if wide.any():
            w = sel[wide]
            nucleus[cut.full[w]] = _nucleus_cut(_sorted_desc(_take(cut.scaled, w)), _sorted_desc(_take(cut.probs, w)),
                                                top_p[cut.full[w]], np.full(w.size, vocab), total[wide])
    cut.thresh = np.fmax(cut.thresh, nucleus).astype(np.float32)
    cut.rebound(vocab)


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


def _draw_window(cut: _Cut, rows: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse CDF over a row's kept window in token-id order (canonical, whatever topk's tie order)."""
    vals, ids = cut.vals[rows], cut.ids[rows]
    outside = (np.arange(vals.shape[1]) >= cut.width[rows, None]) | (vals < cut.thresh[rows, None])
    ids = np.where(outside, np.iinfo(np.int64).max, ids)
    order = np.argsort(ids, axis=1, kind="stable")
    mass = np.where(outside, 0.0, np.exp(vals - vals[:, :1]))
    cdf = np.cumsum(np.take_along_axis(mass, order, axis=1), axis=1, dtype=np.float64)
    pos = (cdf < (u * cdf[:, -1])[:, None]).sum(axis=1)
    return np.take_along_axis(ids, order, axis=1)[np.arange(len(rows)), pos]


def _draw_full(cut: _Cut, sel: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse CDF over the whole vocabulary in id order, for positions ``sel`` of ``cut.full``."""
    probs, thresh = _take(cut.probs, sel), cut.thresh[cut.full[sel]]
    if (thresh > cut.masked[sel]).any():   # top_p raised the cut since ``probs`` was masked
        probs = paddle.masked_fill(probs, _take(cut.scaled, sel) < paddle.to_tensor(thresh[:, None]), 0.0)
    cdf = paddle.cumsum(probs, axis=1)
    total = cdf[:, -1].contiguous().numpy().astype(np.float64)
    target = np.minimum(u * total, total).astype(np.float32)   # > 0, so never a zero-mass token
    return paddle.searchsorted(cdf, paddle.to_tensor(target[:, None])).numpy()[:, 0]


# ------------------------------------------------------------------------------------------------
# the sampler
# ------------------------------------------------------------------------------------------------


class Sampler:
    """Stateless apart from the generator of unseeded rows; call once per step."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = np.random.default_rng(seed)

    def __call__(self, logits, meta: SamplingMetadata) -> SamplerOutput:
        """``logits``: fp32 paddle [num_reqs, vocab], one row per request sampling this step.
        Penalties are applied to ``logits`` in place unless a row asked for (raw) logprobs."""
        wants_logprobs = meta.max_num_logprobs >= 0
        processed = apply_penalties(logits, meta, inplace=not wants_logprobs)
        if meta.all_random:
            tokens = self._sample_random(processed, meta)
        else:
            tokens = processed.argmax(axis=1).numpy().astype(np.int64)
            if not meta.all_greedy:
                rand = np.nonzero(~meta.greedy)[0]
                tokens[rand] = self._sample_random(_take(processed, rand), meta.rows(rand))
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
        sub, sub_meta = _take(processed, rand), meta.rows(rand)
        thresh = _cut(sub, sub_meta).thresh
        scaled = sub * paddle.to_tensor((1.0 / sub_meta.temperature).astype(np.float32)[:, None])
        kept = paddle.masked_fill(scaled, scaled < paddle.to_tensor(thresh[:, None]), float("-inf"))
        return paddle.scatter(processed, paddle.to_tensor(rand), kept, overwrite=True)

    def _sample_random(self, logits, meta: SamplingMetadata) -> np.ndarray:
        cut = _cut(logits, meta)
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
    picked = _pick(logits, tokens[:, None])
    ge = logits >= paddle.to_tensor(picked)
    out.sampled_ranks = ge.astype("float32").sum(axis=1).numpy().astype(np.int64)
    out.sampled_logprobs = (picked[:, 0] - lse).astype(np.float32)
    ids, vals = np.zeros((len(tokens), 0), np.int64), np.zeros((len(tokens), 0), np.float32)
    if num_top > 0:
        vals, ids = _topk(logits, num_top)
        order = np.lexsort((ids, -vals), axis=1)   # ties: lower id first
        vals, ids = np.take_along_axis(vals, order, 1), np.take_along_axis(ids, order, 1)
    out.top_token_ids = ids
    out.top_logprobs = (vals - lse[:, None]).astype(np.float32)
