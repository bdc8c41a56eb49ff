"""The one routing rule (`select_experts`) against the formulas, written independently in numpy.

Every variant a supported checkpoint uses: Qwen's softmax top-k (renormalised or not), ERNIE-4.5's
selection-only bias with a floored renormalisation, DeepSeek-V3 / GLM-4.5's sigmoid scores with
groups and a scaling factor. Random logits have no ties, so the chosen ids must match exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from fdplug.core.portable.moe_routing import select_experts  # noqa: E402
from fdplug.plugin_api.moe import Routing  # noqa: E402
from fdplug.testing.cases import naive_routing  # noqa: E402

VARIANTS = {
    "qwen": Routing(4),
    "qwen-norm": Routing(8, renormalize=True),
    "ernie": Routing(6, bias=True, renormalize=True, norm_floor=1e-12, router_dtype="float32"),
    "sigmoid": Routing(2, scoring="sigmoid"),
    "grouped": Routing(8, scoring="sigmoid", bias=True, num_groups=8, topk_groups=4, renormalize=True,
                       norm_floor=1e-20, scaling=2.5),
    "grouped-softmax": Routing(3, num_groups=4, topk_groups=1),
}


def _route(logits: np.ndarray, routing: Routing, bias: np.ndarray | None):
    weights, ids = select_experts(paddle.to_tensor(logits), routing,
                                  paddle.to_tensor(bias) if routing.bias else None)
    assert weights.dtype == paddle.float32 and ids.dtype == paddle.int64
    return weights.numpy(), ids.numpy()


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("tokens", [1, 57])
def test_select_experts_matches_the_formulas(name, tokens):
    routing = VARIANTS[name]
    rng = np.random.default_rng(len(name) * 100 + tokens)
    logits = (2 * rng.standard_normal((tokens, 32))).astype(np.float32)
    bias = (0.3 * rng.standard_normal(32)).astype(np.float32)
    weights, ids = _route(logits, routing, bias)
    want_weights, want_ids = naive_routing(logits, routing, bias)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-5, atol=1e-7)


def test_the_bias_chooses_but_does_not_weigh():
    """ERNIE-4.5: a large bias on expert 5 makes every token pick it, with its *unbiased* probability."""
    routing = Routing(2, bias=True)
    logits = np.random.default_rng(0).standard_normal((10, 8)).astype(np.float32)
    bias = np.zeros(8, np.float32)
    bias[5] = 10.0
    weights, ids = _route(logits, routing, bias)
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert (ids[:, 0] == 5).all()
    np.testing.assert_allclose(weights[:, 0], probs[:, 5], rtol=1e-6)


def test_renormalisation_floor_caps_tiny_sums():
    """moe_norm_min: weights whose sum is below the floor are divided by the floor, not blown up."""
    routing = Routing(1, scoring="sigmoid", renormalize=True, norm_floor=0.5)
    logits = np.array([[-8.0, -9.0], [3.0, -9.0]], np.float32)   # sigmoid(-8) ~ 3e-4, sigmoid(3) ~ 0.95
    weights, _ = _route(logits, routing, None)
    np.testing.assert_allclose(weights[:, 0], [1 / (1 + np.exp(8)) / 0.5, 1.0], rtol=1e-6)


def test_groups_confine_the_choice():
    """With 1 of 4 groups kept, both experts come from the group whose best two scores sum highest,
    even when the single best expert lies in another group."""
    routing = Routing(2, scoring="sigmoid", num_groups=4, topk_groups=1)
    logits = np.full((1, 8), -4.0, np.float32)
    logits[0, 0] = 5.0                    # group 0: best single expert, weak partner
    logits[0, [6, 7]] = 3.0               # group 3: two strong experts
    _, ids = _route(logits, routing, None)
    assert sorted(ids[0]) == [6, 7]


@pytest.mark.parametrize("routing, experts, words", [
    (Routing(9), 8, "top_k=9"),
    (Routing(2, num_groups=3), 8, "n_group=3"),
    (Routing(2, num_groups=4, topk_groups=5), 8, "topk_group=5"),
    (Routing(5, num_groups=4, topk_groups=2), 8, "exceeds"),
    (Routing(2, scoring="relu"), 8, "relu"),
])
def test_impossible_routings_are_named(routing, experts, words):
    assert any(words in p for p in routing.problems(experts)), routing.problems(experts)
    assert Routing(2).problems(8) == []
