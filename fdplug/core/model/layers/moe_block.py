"""The mixture-of-experts MLP of a decoder layer: router, the one routing rule, routed and shared experts.

``forward`` is four steps: router logits (a plain matmul, in float32 where the checkpoint's router
is), `select_experts` (the core's routing rule, the same for every backend), the selected MoE
backend over the chosen experts, and the shared expert (a SwiGLU every token goes through,
optionally scaled by a sigmoid gate) added on top.

The routed experts arrive from the checkpoint as two stacked parameters in Hugging Face layout,
``experts_gate_up [E, 2I, H]`` (each expert's gate rows, then its up rows) and ``experts_down
[E, H, I]``. When the loader has filled both, `load_experts` hands them to the backend, which
converts them to its own layout once, and the parameters are dropped: the backend's copy is the
only one that stays. A GGUF file stacks gate and up apart, each in its own GGML type (a Q4_K_M file
has Q4_K gate/up and Q6_K down), so its experts are three parameters, ``experts_gate``,
``experts_up`` ``[E, I, row_bytes]`` and ``experts_down`` ``[E, H, row_bytes]``, uint8, the file's
bytes: the backend gets them as the ``gguf`` weight format (`ExpertWeights.qtypes`), still quantized
(as float ``[E, I, H]`` and ``[E, H, I]`` where every expert tensor of the file is F32).

Expert parallel (``expert_parallel``, a `lockstep.LockstepGroup`): the backend gets only this
rank's slice of the experts, and the routed step is ``expert_round``: the group's exchange
dispatches every assignment to its expert's rank, the backend runs the ones routed here, the
exchange combines them back. An idle rank calls ``expert_round(None)`` (zero tokens) so the
others' collectives complete; when the backend raises, the combine still runs, flagged (the ranks
whose tokens it served fail their pass rather than go on without those rows).
"""

from __future__ import annotations

from math import prod
from typing import Any

import paddle
import paddle.nn.functional as F
from paddle import nn

from fdplug.core.model.checkpoint.gguf_weights import GGUF
from fdplug.core.model.checkpoint.moe_config import MoEConfig
from fdplug.core.model.checkpoint.quant_config import (
    QuantConfig,
    fused_quant,
    mlp_quant,
    shared_expert_prefix,
)
from fdplug.core.model.layers.basic import SwiGLU
from fdplug.core.model.layers.linear import empty_parameter
from fdplug.core.portable.moe_routing import select_experts
from fdplug.core.quant.fp8_rows import FP8_DTYPE
from fdplug.plugin_api.gguf_formats import row_bytes
from fdplug.plugin_api.moe import ExpertsFailedError, ExpertWeights
from fdplug.plugin_api.ops import Kernels

# scales: FP8; gate and up apart: a GGUF file's
EXPERT_PARAMS = ("experts_gate_up", "experts_down", "experts_gate_up_scale", "experts_down_scale", "experts_gate",
                 "experts_up")


class SparseMoEBlock(nn.Layer):
    def __init__(self, hidden: int, moe: MoEConfig, backend: Any, dtype: str, kernels: Kernels,
                 quant: QuantConfig | None = None, prefix: str = "", bf16: bool = False,
                 expert_parallel: Any = None) -> None:
        """``quant``/``prefix``: the checkpoint's FP8 config and this layer's HF name (``model.layers.3.``);
        FP8 experts stay e4m3 with per-row scales (`fp8_layers`) until the backend takes them.
        ``bf16``: the shared expert's float weights kept bf16 (`layers.make_linear`); the routed
        experts are the backend's, in the compute dtype."""
        super().__init__()
        self.routing, self.backend = moe.routing, backend
        self.hidden, self.dtype = hidden, dtype
        self.expert_parallel = expert_parallel
        if expert_parallel is not None:
            expert_parallel.blocks.append(self)
        self.router_dtype = "float32" if moe.routing.router_dtype == "float32" else dtype
        e, inter = moe.num_experts, moe.intermediate_size
        self.router = empty_parameter([hidden, e], self.router_dtype)          # HF mlp.gate.weight, transposed
        self.e_score_correction_bias = empty_parameter([1, e], "float32") if moe.routing.bias else None
        gguf = quant if getattr(quant, "format", None) == GGUF else None   # a GGUF file (`GgufQuant`)
        self.split = gguf is not None      # gate and up as two parameters (a GGUF file's stacks)
        self.gguf_types = (gguf.expert_types(prefix + "mlp.experts.") if gguf is not None and
                           gguf.expert_format == GGUF else {})
        self.quant = None if gguf is not None else fused_quant(quant, prefix + "mlp.experts.",
                                                               ("gate_proj", "up_proj", "down_proj"))
        expert_dtype = FP8_DTYPE if self.quant else dtype
        if self.split:
            for name, rows, cols in (("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter)):
                qtype = self.gguf_types.get(name)
                shape = [e, rows, row_bytes(qtype, cols)] if qtype else [e, rows, cols]
                setattr(self, f"experts_{name}", empty_parameter(shape, "uint8" if qtype else dtype))
        else:
            self.experts_gate_up = empty_parameter([e, 2 * inter, hidden], expert_dtype)
            self.experts_down = empty_parameter([e, hidden, inter], expert_dtype)
        if self.quant:
            bk = self.quant.block[1]
            self.experts_gate_up_scale = empty_parameter([e, 2 * inter, -(-hidden // bk)], "float32")
            self.experts_down_scale = empty_parameter([e, hidden, -(-inter // bk)], "float32")
        self.experts: Any = None    # the backend's layer, once loaded
        self.expert_bytes = 0       # what the backend was handed (the parameters are dropped)
        shared = shared_expert_prefix(prefix, moe.shared_gate) if moe.shared_intermediate_size else ""
        self.shared_expert = (SwiGLU(hidden, moe.shared_intermediate_size, False, dtype, kernels,
                                     mlp_quant(quant, shared), bf16)
                              if moe.shared_intermediate_size else None)
        self.shared_expert_gate = empty_parameter([hidden, 1], dtype) if moe.shared_gate else None

    def load_experts(self) -> None:
        """Hand the filled expert parameters to the backend and drop them (called by the loader)."""
        shard = self.expert_parallel.shard if self.expert_parallel is not None else None

        def mine(t: Any) -> Any:   # this rank's experts, copied (the full tensors are freed); alone: a view
            return t if shard is None else t[shard.first:shard.first + shard.count].clone()

        if self.split:
            weights = ExpertWeights(mine(self.experts_gate), mine(self.experts_up), mine(self.experts_down))
            if self.gguf_types:
                weights.format, weights.qtypes = GGUF, dict(self.gguf_types)
            self.experts_gate = self.experts_up = None
        else:
            inter = self.experts_gate_up.shape[1] // 2
            gate_up = mine(self.experts_gate_up)
            weights = ExpertWeights(gate_up[:, :inter], gate_up[:, inter:], mine(self.experts_down))
            self.experts_gate_up = None
        if self.quant:
            scales = mine(self.experts_gate_up_scale)
            weights.format, weights.block = self.quant.format, self.quant.block
            weights.scales = {"gate": scales[:, :inter], "up": scales[:, inter:],
                              "down": mine(self.experts_down_scale)}
            self.experts_gate_up_scale = self.experts_down_scale = None
        self.expert_bytes = sum(prod(t.shape) * t.element_size()     # (paddle's CPU numel() refuses FP8)
                                for t in (weights.gate, weights.up, weights.down, *weights.scales.values()))
        self.experts = self.backend.load_weights(weights)
        self.experts_down = None

    def forward(self, x: Any, correction_bias: Any = None) -> Any:
        """``correction_bias``: the selection bias ``[1, E]`` when its owner holds it (`modality_moe`)."""
        if self.experts is None:
            raise RuntimeError("the MoE experts were never loaded (a loader bug)")
        router_in = x if x.dtype == self.router.dtype else x.astype(self.router_dtype)
        logits = paddle.matmul(router_in, self.router)
        bias = self.e_score_correction_bias if correction_bias is None else correction_bias
        weights, ids = select_experts(logits, self.routing, bias)
        if self.expert_parallel is None:
            out = self.backend.forward(x, weights, ids, self.experts)
        else:
            out = self.expert_round(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = F.sigmoid(paddle.matmul(x, self.shared_expert_gate)) * shared
            out = out + shared
        return out

    def expert_round(self, x: Any | None, weights: Any = None, ids: Any = None) -> Any:
        """The routed experts across the expert-parallel group; ``x`` None: this rank has no tokens
        in this pass (a dummy round: its experts serve the other ranks' tokens). When the backend
        raises, the combine still runs (the others wait in it), flagged so the ranks it served fail
        their pass too; then the backend's error goes on."""
        group = self.expert_parallel
        if x is None:
            k = self.routing.top_k
            x = paddle.zeros([0, self.hidden], dtype=self.dtype)
            weights, ids = paddle.zeros([0, k], dtype="float32"), paddle.zeros([0, k], dtype="int64")
        batch = group.exchange.dispatch(x, weights, ids)
        rows, error = int(batch.hidden.shape[0]), None
        try:
            out = (self.backend.forward(batch.hidden, batch.topk_weights, batch.topk_ids, self.experts) if rows
                   else paddle.zeros([0, self.hidden], dtype=x.dtype))
        except Exception as exc:
            error, out = exc, paddle.zeros([rows, self.hidden], dtype=x.dtype)
        try:
            combined = group.exchange.combine(out, batch, failed=error is not None)
        except ExpertsFailedError:
            if error is None:
                raise
        finally:
            group.moe_layer()
        if error is not None:
            raise error
        return combined
