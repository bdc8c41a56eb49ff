"""``cpu_native`` MoE: the routed experts of a layer in one compiled call, every core busy.

The reference backend loops over experts in Python: a dozen Paddle ops per expert per layer, so a
decode step of a 32-expert model spends most of its time dispatching. Here `kernels.moe_experts`
groups the assignments by expert once and runs each expert's gate/up and down GEMMs (SwiGLU fused)
as work items spread over the threads, then sums each token's top-k outputs in k order. The weights
are repacked once at load time (`kernels.pack_experts`).

FP8 block experts (``fp8_block``) stay one byte a weight: a layer is one compiled call that runs
both grouped FP8 GEMMs over the experts that got tokens (`Fp8Experts`), no dequantized copy of any.

Routing is the core's (`fdplug.plugin_api.moe.select_experts`); this backend only gets the chosen
ids and weights, so it cannot route differently from any other backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fdplug.errors import ConfigError
from fdplug.plugin_api.moe import ExpertWeights
from fdplug.plugins.cpu import kernels, native_fp8


class NativeCpuMoE:
    name = "cpu_native"

    def __init__(self, threads: int) -> None:
        kernels.load()  # fail at construction, not at the first step
        self.threads = threads

    def load_weights(self, weights: ExpertWeights) -> Any:
        if weights.format == "fp8_block":
            return Fp8Experts.from_weights(weights)
        if weights.format != "none":
            raise ConfigError(f"the cpu_native MoE backend runs float and fp8_block experts, not {weights.format!r}.",
                              fix="select a MoE backend that executes this format (`fdplug explain --moe ...`).")
        return kernels.pack_experts(weights.gate, weights.up, weights.down)

    def forward(self, hidden: Any, topk_weights: Any, topk_ids: Any, layer: Any) -> Any:
        if isinstance(layer, Fp8Experts):
            return layer.forward(hidden, topk_weights, topk_ids, self.threads)
        ids = np.ascontiguousarray(topk_ids.numpy(), dtype=np.int32)
        weights = np.ascontiguousarray(topk_weights.numpy(), dtype=np.float32)
        return kernels.moe_experts(hidden, layer, ids, weights, self.threads)


@dataclass(slots=True)
class Fp8Experts:
    """A layer's FP8 experts kept one byte a weight: ``w13 [E, 2I, H]`` (gate rows, then up) and
    ``w2 [E, H, I]`` e4m3 with their per-row block scales, read in place by one compiled call a
    layer (`native_fp8.fp8_moe`)."""

    w13: Any
    s13: Any
    w2: Any
    s2: Any
    block_k: int

    @classmethod
    def from_weights(cls, weights: ExpertWeights) -> Fp8Experts:
        import paddle

        w13 = paddle.concat([weights.gate.view(paddle.uint8), weights.up.view(paddle.uint8)], axis=1)
        s13 = paddle.concat([weights.scales["gate"], weights.scales["up"]], axis=1)
        return cls(w13.view(paddle.float8_e4m3fn), s13, weights.down, weights.scales["down"], weights.block[1])

    def forward(self, hidden: Any, topk_weights: Any, topk_ids: Any, threads: int) -> Any:
        return native_fp8.fp8_moe(hidden, self, topk_ids.numpy(), topk_weights.numpy(), threads)
