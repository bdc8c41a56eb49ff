"""Temperature, min_p, top_k and top_p of random rows folded into one threshold per row.

Each filter keeps the tokens whose scaled logit is at or above a cut, so the three fold into **one
threshold per row**, and tokens tied at a boundary are all kept (vLLM keeps an arbitrary subset of a
top_p tie). Cuts are found on a small sorted window (a top-k) rather than a full sort (Paddle's CPU
sort of [64, 151936] takes ~1 s); a full sort is only the fallback for a top_p nucleus wider than the
window. Every choice of path is made from the row alone, so a row takes the same path in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fdplug.plugin_api.paddle import import_paddle

if TYPE_CHECKING:
    from fdplug.core.model.sampling.metadata import SamplingMetadata

paddle = import_paddle()

TOP_P_WINDOW = 1024   # sorted candidates searched for a top_p / min_p cut before a full sort


def take_rows(x, rows: np.ndarray):
    """Rows of a paddle tensor, without a copy when that is all of them."""
    return x if rows.size == x.shape[0] else paddle.index_select(x, paddle.to_tensor(rows))


def pick_cols(x, cols: np.ndarray) -> np.ndarray:
    """x[i, cols[i, j]] as numpy: a flat gather (take_along_axis copies all of x on CPU)."""
    flat = np.arange(cols.shape[0])[:, None] * x.shape[1] + cols
    return paddle.gather(x.reshape([-1]), paddle.to_tensor(flat.reshape(-1))).numpy().reshape(cols.shape)


def _on_cpu(x) -> bool:
    """Whether numpy may read ``x`` in place (dlpack) for a kernel Paddle's CPU build does slowly."""
    return x.place.is_cpu_place()


def row_topk(x, k: int) -> tuple[np.ndarray, np.ndarray]:
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
class Cut:
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


def cut_for(logits, meta: SamplingMetadata) -> Cut:
    """Temperature, min_p, top_k and top_p of random rows as one threshold per row."""
    num_reqs, vocab = logits.shape
    rows = np.arange(num_reqs)
    inv_t = (1.0 / meta.temperature).astype(np.float32)
    k_on = (meta.top_k > 0) & (meta.top_k < vocab)
    p_on, mp_on = meta.top_p < 1, meta.min_p > 0
    width = np.where(k_on, np.minimum(meta.top_k + 1, vocab), np.where(p_on | mp_on, min(TOP_P_WINDOW, vocab), 0))
    vals, ids = np.zeros((num_reqs, 1), np.float32), np.zeros((num_reqs, 1), np.int64)
    if width.any():   # topk before scaling: same order, and only the window gets scaled
        vals, ids = row_topk(logits, int(width.max()))
        vals = vals * inv_t[:, None]
    thresh = np.full(num_reqs, -np.inf, np.float32)
    if mp_on.any():   # p >= min_p * p_max  <=>  s >= s_max + log(min_p)
        with np.errstate(divide="ignore"):
            thresh = np.where(mp_on, vals[:, 0] + np.log(meta.min_p), thresh).astype(np.float32)
    if k_on.any():
        kth = vals[rows, np.clip(meta.top_k - 1, 0, vals.shape[1] - 1)]
        thresh = np.where(k_on, np.maximum(thresh, kth), thresh)
    cut = Cut(thresh, vals, ids, width, vals[rows, np.maximum(width - 1, 0)], None, None)
    cut.rebound(vocab)
    cut.full = np.nonzero(~cut.bounded)[0]
    if cut.full.size:
        _full_probs(cut, logits, inv_t)
    if p_on.any():
        _top_p(cut, meta.top_p, vocab)
    return cut


def _full_probs(cut: Cut, logits, inv_t: np.ndarray) -> None:
    """Softmax over the vocabulary for rows not bounded to a window, masked at their threshold."""
    cut.scaled = take_rows(logits, cut.full)
    if (inv_t[cut.full] != 1).any():
        cut.scaled = cut.scaled * paddle.to_tensor(inv_t[cut.full, None])
    cut.probs = paddle.nn.functional.softmax(cut.scaled, axis=1)
    cut.masked = cut.thresh[cut.full]
    if np.isfinite(cut.masked).any():
        cut.probs = paddle.masked_fill(cut.probs, cut.scaled < paddle.to_tensor(cut.masked[:, None]), 0.0)


def _top_p(cut: Cut, top_p: np.ndarray, vocab: int) -> None:
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
        probs = take_rows(cut.probs, sel)
        total = probs.sum(axis=1).numpy().astype(np.float64)
        nucleus[rows] = _nucleus_cut(cut.vals[rows], pick_cols(probs, cut.ids[rows]), top_p[rows], cut.width[rows],
                                     total)
        wide = np.isnan(nucleus[rows])
        if wide.any():
            w = sel[wide]
            nucleus[cut.full[w]] = _nucleus_cut(_sorted_desc(take_rows(cut.scaled, w)),
                                                _sorted_desc(take_rows(cut.probs, w)),
                                                top_p[cut.full[w]], np.full(w.size, vocab), total[wide])
    cut.thresh = np.fmax(cut.thresh, nucleus).astype(np.float32)
    cut.rebound(vocab)
