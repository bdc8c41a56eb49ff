"""``cpu_native`` MoE: the routed experts of a layer in one compiled call, every core busy.

The reference backend loops over experts in Python: a dozen Paddle ops per expert per layer, so a
decode step of a 32-expert model spends most of its time dispatching. Here `kernels.moe_experts`
groups the assignments by expert once and runs each expert's gate/up and down GEMMs (SwiGLU fused)
as work items spread over the threads, then sums each token's top-k outputs in k order. The weights
are repacked once at load time (`kernels.pack_experts`).

Routing is the core's (`fdplug.plugin_api.moe.select_experts`); this backend only gets the chosen
ids and weights, so it cannot route differently from any other backend.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fdplug.errors import ConfigError
from fdplug.plugin_api.moe import ExpertWeights
from fdplug.plugins.cpu import kernels


class NativeCpuMoE:
    name = "cpu_native"

    def __init__(self, threads: int) -> None:
        kernels.load()  # fail at construction, not at the first step
        self.threads = threads

    def load_weights(self, weights: ExpertWeights) -> Any:
        if weights.format != "none":
            raise ConfigError(f"the cpu_native MoE backend runs plain float experts, not {weights.format!r}.",
                              fix="select a MoE backend that executes this format (`fdplug explain --moe ...`).")
        return kernels.pack_experts(weights.gate, weights.up, weights.down)

    def forward(self, hidden: Any, topk_weights: Any, topk_ids: Any, layer: Any) -> Any:
        ids = np.ascontiguousarray(topk_ids.numpy(), dtype=np.int32)
        weights = np.ascontiguousarray(topk_weights.numpy(), dtype=np.float32)
        return kernels.moe_experts(hidden, layer, ids, weights, self.threads)
