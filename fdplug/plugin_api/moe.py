"""The MoE contract: expert weights in, routed expert output out.

The model computes the router logits (a plain linear layer, shared code); a MoE backend owns the
expert weights in its own layout and the routed computation. ``select_experts`` is the routing rule
every backend must reproduce, so it lives here once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(slots=True)
class ExpertWeights:
    """One MoE layer's experts, in Hugging Face ``nn.Linear`` layout (``[out, in]`` per expert).

    ``gate`` and ``up`` are ``[num_experts, intermediate, hidden]``, ``down`` is
    ``[num_experts, hidden, intermediate]``. For quantized formats (``format != "none"``) the tensors
    hold the quantized values and ``scales`` the matching scale tensors keyed ``gate``/``up``/``down``.
    """

    gate: Any
    up: Any
    down: Any
    format: str = "none"
    scales: dict[str, Any] = field(default_factory=dict)

    @property
    def num_experts(self) -> int:
        return int(self.gate.shape[0])


def select_experts(router_logits: Any, top_k: int, renormalize: bool) -> tuple[Any, Any]:
    """Softmax routing: per token, the ``top_k`` experts and their weights (fp32).

    With ``renormalize`` the chosen weights are rescaled to sum to 1 (Qwen-MoE ``norm_topk_prob``).
    Returns ``(weights [T, top_k] float32, expert_ids [T, top_k] int64)``.
    """
    import paddle

    probs = paddle.nn.functional.softmax(router_logits.astype("float32"), axis=-1)
    weights, ids = paddle.topk(probs, k=top_k, axis=-1)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdim=True)
    return weights, ids


@runtime_checkable
class MoEBackend(Protocol):
    """What a MoE backend's factory returns."""

    name: str

    def load_weights(self, weights: ExpertWeights) -> Any:
        """Convert one layer's expert weights to this backend's layout; called once at load time."""
        ...

    def forward(self, hidden: Any, router_logits: Any, layer: Any, top_k: int, renormalize: bool) -> Any:
        """``hidden [T, H]`` and ``router_logits [T, E]`` -> routed expert output ``[T, H]``.

        ``layer`` is what ``load_weights`` returned. Activation is SwiGLU:
        ``down(silu(gate(x)) * up(x))``, weighted by the routing weights and summed over the top-k.
        """
        ...
