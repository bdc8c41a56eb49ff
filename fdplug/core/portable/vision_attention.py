"""The portable ``vision_attention`` op: bidirectional attention within segments of a flat token
sequence (a vision tower's windows and frames).

Segments of equal length are gathered into one batched matmul, so an image of many windows costs
a handful of Paddle calls (its full windows, and the few cut at the right and bottom edges), not
one per window.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F


def vision_attention(q: Any, k: Any, v: Any, bounds: np.ndarray, scale: float) -> Any:
    """``q, k, v [N, heads, D]``; ``bounds``: segment boundaries ``[0, ..., N]`` -> ``[N, heads, D]``,
    each token attending to every token of its segment and to no other."""
    bounds = np.asarray(bounds, dtype=np.int64)
    starts, lengths = bounds[:-1], np.diff(bounds)
    if len(lengths) == 1:
        return _attend(q[None], k[None], v[None], scale)[0]
    out = paddle.zeros_like(q)
    for length in np.unique(lengths[lengths > 0]):
        first = starts[lengths == length]
        rows = paddle.to_tensor((first[:, None] + np.arange(length)[None, :]).ravel())
        shape = [len(first), int(length), q.shape[1], q.shape[2]]
        gathered = (paddle.gather(t, rows).reshape(shape) for t in (q, k, v))
        out = paddle.scatter(out, rows, _attend(*gathered, scale).reshape([-1, q.shape[1], q.shape[2]]))
    return out


def _attend(q: Any, k: Any, v: Any, scale: float) -> Any:
    """``[B, L, heads, D]`` each -> softmax(q k^T * scale) v, per batch entry and head."""
    q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))
    weights = F.softmax(paddle.matmul(q, k, transpose_y=True) * scale, axis=-1)
    return paddle.matmul(weights, v).transpose([0, 2, 1, 3])
