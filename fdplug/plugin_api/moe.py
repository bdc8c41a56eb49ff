"""The MoE contract: how a layer routes (`Routing`), and what a MoE backend computes.

A MoE layer is three parts, and only the last belongs to a backend:

1. the router: a plain linear layer in the model giving ``router_logits [T, E]``;
2. the routing rule, applied by the core (`fdplug.core.portable.moe_routing.select_experts`) with
   the layer's `Routing`: which ``top_k`` experts each token goes to and with what weight. The core
   applies it, once, before any backend runs, so no backend can route differently;
3. the routed experts: `MoEBackend.forward` takes the hidden states and the chosen
   ``(weights, ids)`` and returns ``sum_k weight_k * expert_{id_k}(x)``. The backend owns the
   expert weights in its own layout (``load_weights`` converts them once at load time).

Shared experts (Qwen2-MoE's gated one, ERNIE-4.5's ungated ones) are ordinary MLPs of the model,
not a backend's business.

Expert parallel (``--expert-parallel-size N``): each rank's backend holds ``1/N`` of a layer's
experts, and an `ExpertExchange` moves work between ranks around ``forward``: ``dispatch`` turns this
rank's tokens and their chosen experts into an `ExpertBatch` of the assignments *this rank's*
experts must run (from every rank, one row per assignment, local ids), the backend runs them as
usual (``K = 1``), and ``combine`` brings each assignment's row back to the rank that owns its
token and sums a token's rows. The core's exchanges (`fdplug.core.parallel.exchange`) are chosen by
what the collective backend can do (all_to_all where it exists, all_gather + all_reduce on every
backend); a backend that brings its own (DeepEP-style) defines ``make_exchange``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True, slots=True)
class Routing:
    """How one MoE layer picks and weighs its experts (from the checkpoint's config.json).

    - ``scoring``: ``softmax`` over the experts (Qwen-MoE, ERNIE-4.5) or an independent
      ``sigmoid`` per expert (DeepSeek-V3, GLM-4.5). Scores are always computed in float32.
    - ``bias``: whether the layer has a selection bias (``e_score_correction_bias``): added to the
      scores to *choose* experts, never to weigh them.
    - ``num_groups`` / ``topk_groups``: grouped routing. Experts are split into ``num_groups``
      equal groups, a group scores the sum of its two best (biased) scores, and only the
      ``topk_groups`` best groups may be chosen from.
    - ``renormalize``: divide the chosen weights by their sum, clamped below at ``norm_floor``
      (ERNIE-4.5's ``moe_norm_min``; 0 for Qwen's ``norm_topk_prob``).
    - ``scaling``: every weight times this (``routed_scaling_factor``).
    - ``router_dtype``: ``model`` (the router matmul runs in the model's dtype, Qwen) or ``float32``
      (ERNIE-4.5 keeps its router weight and matmul in float32).
    """

    top_k: int
    scoring: str = "softmax"
    bias: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    renormalize: bool = False
    norm_floor: float = 0.0
    scaling: float = 1.0
    router_dtype: str = "model"

    def problems(self, num_experts: int) -> list[str]:
        """What makes this routing impossible for ``num_experts`` experts (empty: fine)."""
        out = []
        if self.scoring not in SCORINGS:
            out.append(f"scoring {self.scoring!r} is not one of {', '.join(SCORINGS)}")
        if not 1 <= self.top_k <= num_experts:
            out.append(f"top_k={self.top_k} must be between 1 and the {num_experts} experts")
        if self.num_groups < 1 or num_experts % self.num_groups:
            out.append(f"{num_experts} experts do not split into n_group={self.num_groups} equal groups")
        elif not 1 <= self.topk_groups <= self.num_groups:
            out.append(f"topk_group={self.topk_groups} must be between 1 and n_group={self.num_groups}")
        elif self.top_k > self.topk_groups * (num_experts // self.num_groups):
            out.append(f"top_k={self.top_k} exceeds the {self.topk_groups * (num_experts // self.num_groups)} "
                       f"experts in the topk_group={self.topk_groups} groups kept")
        if self.norm_floor < 0 or self.scaling <= 0:
            out.append(f"moe_norm_min={self.norm_floor} must be >= 0 and the scaling factor {self.scaling} > 0")
        if self.router_dtype not in ("model", "float32"):
            out.append(f"router_dtype {self.router_dtype!r} is not 'model' or 'float32'")
        return out

    def describe(self) -> str:
        parts = [f"{self.scoring} top-{self.top_k}"]
        if self.num_groups > 1:
            parts.append(f"{self.topk_groups} of {self.num_groups} groups")
        if self.bias:
            parts.append("selection bias")
        if self.renormalize:
            parts.append("renormalised" + (f" (floor {self.norm_floor:g})" if self.norm_floor else ""))
        if self.scaling != 1.0:
            parts.append(f"x{self.scaling:g}")
        return ", ".join(parts)


@dataclass(slots=True)
class ExpertWeights:
    """One MoE layer's routed experts, in Hugging Face ``nn.Linear`` layout (``[out, in]`` per expert).

    ``gate`` and ``up`` are ``[num_experts, intermediate, hidden]``, ``down`` is
    ``[num_experts, hidden, intermediate]``. For quantized formats (``format != "none"``) the tensors
    hold the quantized values and ``scales`` the matching scale tensors keyed ``gate``/``up``/``down``.
    ``fp8_block``: e4m3 values and float32 scales *per row*, ``[E, rows, ceil(cols / block[1])]`` (a
    checkpoint's ``block[0]``-row tiles repeated over their rows), so ``W[e, i, j] = q[e, i, j] *
    scales[e, i, j // block[1]]``.
    ``gguf`` (API 3.13; a GGUF file's experts, kept as stored): uint8 ``[E, rows, row_bytes]``, each row
    the file's bytes of one weight row in GGML blocks, and ``qtypes`` the GGML type of each tensor keyed
    ``gate``/``up``/``down`` (`fdplug.plugin_api.gguf_formats`: ``row_bytes(qtypes[name], cols)`` is the
    last dim; one file mixes types, a Q4_K_M file has Q4_K gate/up and Q6_K down in some layers).
    No scales: the blocks carry theirs. ``fdplug.core.quant.gguf_blocks.dequantize`` is the reference.
    """

    gate: Any
    up: Any
    down: Any
    format: str = "none"
    scales: dict[str, Any] = field(default_factory=dict)
    block: tuple[int, int] = (128, 128)
    qtypes: dict[str, str] = field(default_factory=dict)    # gguf: GGML type by ``gate``/``up``/``down``

    @property
    def num_experts(self) -> int:
        return int(self.gate.shape[0])

    def check_gguf(self) -> None:
        """For the ``gguf`` format: each of gate/up/down is uint8 ``[E, rows, row_bytes(qtypes[name],
        cols)]`` (``cols``: the hidden size for gate and up, the intermediate size for down); a
        ValueError says which is not (a type outside `gguf_formats` is an UnsupportedModelError)."""
        from fdplug.plugin_api.gguf_formats import row_bytes

        inter, hidden = int(self.gate.shape[1]), int(self.down.shape[1])
        for name, cols in (("gate", hidden), ("up", hidden), ("down", inter)):
            t, qtype = getattr(self, name), self.qtypes.get(name)
            if qtype is None or str(t.dtype) != "paddle.uint8" or int(t.shape[-1]) != row_bytes(qtype, cols):
                raise ValueError(f"gguf experts: {name} must be uint8 [E, rows, row_bytes({qtype}, {cols})], got "
                                 f"{t.dtype} {list(t.shape)}")


@dataclass(slots=True)
class ExpertBatch:
    """What ``ExpertExchange.dispatch`` gives this rank's backend: one row per (token, expert)
    assignment routed to this rank's experts, from any rank.

    ``hidden [A, H]``, ``topk_ids [A, 1]`` int64 local expert ids (``0 .. experts per rank - 1``),
    ``topk_weights [A, 1]`` float32; ``state`` is the exchange's own (what ``combine`` needs)."""

    hidden: Any
    topk_ids: Any
    topk_weights: Any
    state: Any = None


class ExpertsFailedError(RuntimeError):
    """Raised by ``ExpertExchange.combine`` on a rank whose tokens another rank's experts failed to
    run in this layer: the rows are missing, so the pass fails (and is contained) rather than
    continuing with them."""


@runtime_checkable
class ExpertExchange(Protocol):
    """Moves a MoE layer's work between the ranks of an expert-parallel group (a collective: every
    rank calls ``dispatch`` and ``combine`` once per MoE layer per forward pass, a rank without
    tokens with zero rows)."""

    name: str

    def dispatch(self, hidden: Any, topk_weights: Any, topk_ids: Any) -> ExpertBatch:
        """This rank's tokens ``hidden [T, H]`` with their global ``topk_ids``/``topk_weights
        [T, K]`` -> the assignments this rank's experts run."""
        ...

    def combine(self, expert_out: Any, batch: ExpertBatch, failed: bool = False) -> Any:
        """``expert_out [A, H]`` (the backend's output for ``batch``) -> ``[T, H]``: each of this
        rank's tokens summed over its ``K`` assignments, wherever they ran. ``failed``: this rank's
        experts raised (``expert_out`` is zeros); then every rank whose tokens they served (or simply
        every rank) raises `ExpertsFailedError` once the collective is done."""
        ...


@runtime_checkable
class MoEBackend(Protocol):
    """What a MoE backend's factory returns."""

    name: str

    def load_weights(self, weights: ExpertWeights) -> Any:
        """Convert one layer's expert weights to this backend's layout; called once per layer at load
        time. The returned object is what ``forward`` gets as ``layer``; the backend may keep the
        given tensors or copy them, and the model drops its own references afterwards."""
        ...

    def forward(self, hidden: Any, topk_weights: Any, topk_ids: Any, layer: Any) -> Any:
        """``hidden [T, H]``, ``topk_weights [T, K]`` float32 and ``topk_ids [T, K]`` int64 from
        `select_experts` -> ``[T, H]`` in ``hidden``'s dtype::

            out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = topk_ids[t, k]

        Under expert parallel the layer holds this rank's experts only and ``topk_ids`` are local.
        A backend may also define ``make_exchange(group, rank, size, num_experts) -> ExpertExchange``
        (optional, API 3.6): its own exchange over the paddle.distributed ``group``, used instead of
        the core's.
        """
        ...
