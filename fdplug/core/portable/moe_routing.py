"""The routing rule every MoE layer uses: per token, which experts and with what weight.

The core applies it before the MoE backend runs (`fdplug.plugin_api.moe`: a backend receives the
chosen ``(weights, ids)``), so every backend on every device routes the same way; the layer's
`Routing` (from its checkpoint config) says which variant: softmax or sigmoid scores, a selection
bias, group-limited choice, renormalisation and scaling.
"""

from __future__ import annotations

from typing import Any

from fdplug.plugin_api.moe import Routing


def select_experts(router_logits: Any, routing: Routing, bias: Any | None = None) -> tuple[Any, Any]:
    """The routing rule: per token, ``routing.top_k`` experts and their weights.

    ``router_logits [T, E]`` (any float dtype), ``bias [E]`` float32 when ``routing.bias``.
    Returns ``(weights [T, top_k] float32, expert_ids [T, top_k] int64)``, best expert first.
    """
    import paddle
    import paddle.nn.functional as F

    logits = router_logits.astype("float32")
    scores = F.softmax(logits, axis=-1) if routing.scoring == "softmax" else F.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype("float32").reshape([1, -1])
    if routing.num_groups > 1:
        choice = _keep_best_groups(choice, routing.num_groups, routing.topk_groups)
    _, ids = paddle.topk(choice, k=routing.top_k, axis=-1)
    weights = paddle.take_along_axis(scores, ids, axis=-1)   # the unbiased scores weigh the experts
    if routing.renormalize:
        weights = weights / weights.sum(axis=-1, keepdim=True).clip(min=routing.norm_floor)
    if routing.scaling != 1.0:
        weights = weights * routing.scaling
    return weights, ids


def _keep_best_groups(choice: Any, num_groups: int, topk_groups: int) -> Any:
    """``choice`` with the experts outside each token's ``topk_groups`` best groups set to -inf.

    A group's score is the sum of its two best choice scores (one if a group has one expert).
    Dropped experts become -inf rather than 0 (HF's DeepSeek-V3 uses 0): with a negative selection
    bias a kept expert can score below 0, and a dropped group must still never win.
    """
    import paddle

    tokens, experts = choice.shape
    grouped = choice.reshape([tokens, num_groups, experts // num_groups])
    best, _ = paddle.topk(grouped, k=min(2, experts // num_groups), axis=-1)
    _, kept = paddle.topk(best.sum(axis=-1), k=topk_groups, axis=-1)
    keep = paddle.zeros([tokens, num_groups], dtype="float32")
    keep = paddle.put_along_axis(keep, kept, paddle.ones_like(kept, dtype="float32"), axis=-1)
    mask = keep.unsqueeze(-1).expand_as(grouped).reshape([tokens, experts])
    return paddle.where(mask > 0, choice, paddle.full_like(choice, float("-inf")))
