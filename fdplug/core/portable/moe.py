"""Reference MoE: a loop over the experts that received tokens (routing is the core's `select_experts`).

Plain Paddle ops, so it runs on every device; it is the numerics reference the conformance kit
checks other MoE backends against, not a fast path. Quantized experts stay as stored and an expert
is dequantized only when a step routes tokens to it (``fp8_block`` by `fp8_layers.dequant_rows`,
``gguf`` by `gguf_blocks.dequantize`, ggml's own numbers), the copy dropped after its matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from fdplug.core.quant.fp8_rows import dequant_rows
from fdplug.core.quant.gguf_blocks import dequantize
from fdplug.errors import ConfigError
from fdplug.plugin_api.moe import ExpertWeights


@dataclass(slots=True)
class _Layer:
    gate: Any   # [E, H, I]: transposed once so the hot path is x @ W; fp8_block: [E, I, H] e4m3 as stored
    up: Any     # [E, H, I] (fp8_block: [E, I, H])
    down: Any   # [E, I, H] (fp8_block: [E, H, I])
    scales: dict[str, Any] | None = None    # fp8_block: per-row scales (`ExpertWeights`)
    block_k: int = 128

    def run(self, e: int, x: Any) -> Any:
        """Expert ``e`` on rows ``x [n, H]``: ``down(silu(gate(x)) * up(x))``; FP8 weights are
        dequantized now and used as stored (``[out, in]``, ``transpose_y``: no transposed copy)."""
        if self.scales is None:
            return (F.silu(x @ self.gate[e]) * (x @ self.up[e])) @ self.down[e]
        gate, up, down = (_as(dequant_rows(w[e], self.scales[name][e], self.block_k, "float32"), x.dtype)
                          for name, w in (("gate", self.gate), ("up", self.up), ("down", self.down)))
        h = F.silu(paddle.matmul(x, gate, transpose_y=True)) * paddle.matmul(x, up, transpose_y=True)
        return paddle.matmul(h, down, transpose_y=True)


@dataclass(slots=True)
class _GgufLayer:
    """A GGUF file's experts as stored: uint8 ``[E, rows, row_bytes]`` of the GGML types ``qtypes``."""

    gate: Any
    up: Any
    down: Any
    qtypes: dict[str, str]

    @classmethod
    def from_weights(cls, weights: ExpertWeights) -> _GgufLayer:
        """Checked once (`ExpertWeights.check_gguf`): a wrong type or row size fails at load."""
        weights.check_gguf()
        return cls(weights.gate, weights.up, weights.down, dict(weights.qtypes))

    def run(self, e: int, x: Any) -> Any:
        """Expert ``e`` on rows ``x [n, H]``, its three tensors widened to ``x``'s dtype for the call."""
        dtype = str(x.dtype).removeprefix("paddle.")
        hidden, inter = int(self.down.shape[1]), int(self.gate.shape[1])
        gate, up, down = (dequantize(w[e], self.qtypes[name], k, dtype)
                          for name, w, k in (("gate", self.gate, hidden), ("up", self.up, hidden),
                                             ("down", self.down, inter)))
        h = F.silu(paddle.matmul(x, gate, transpose_y=True)) * paddle.matmul(x, up, transpose_y=True)
        return paddle.matmul(h, down, transpose_y=True)


def _as(t: Any, dtype: Any) -> Any:
    return t if t.dtype == dtype else t.astype(dtype)


class ReferenceMoE:
    name = "reference"

    def load_weights(self, weights: ExpertWeights) -> _Layer | _GgufLayer:
        if weights.format == "fp8_block":      # kept e4m3: dequantized one expert at a time, when used
            return _Layer(weights.gate, weights.up, weights.down, dict(weights.scales), weights.block[1])
        if weights.format == "gguf":           # kept in GGML blocks, likewise
            return _GgufLayer.from_weights(weights)
        if weights.format != "none":
            raise ConfigError(f"the reference MoE backend runs float, fp8_block and gguf experts, not "
                              f"{weights.format!r}.",
                              fix="select a MoE backend that executes this format (`fdplug explain --moe ...`).")
        return _Layer(weights.gate.transpose([0, 2, 1]), weights.up.transpose([0, 2, 1]),
                      weights.down.transpose([0, 2, 1]))

    def forward(self, hidden: Any, topk_weights: Any, topk_ids: Any, layer: _Layer | _GgufLayer) -> Any:
        top_k = int(topk_ids.shape[1])
        flat_ids = topk_ids.numpy().reshape(-1)
        order = np.argsort(flat_ids, kind="stable")            # assignments grouped by expert
        experts, first = np.unique(flat_ids[order], return_index=True)
        bounds = np.append(first, len(order))
        flat_weights = topk_weights.reshape([-1]).astype(hidden.dtype)
        out = paddle.zeros_like(hidden)
        for e, lo, hi in zip(experts, bounds[:-1], bounds[1:]):
            assignments = order[lo:hi]
            tokens = paddle.to_tensor(assignments // top_k)
            x = paddle.gather(hidden, tokens)
            y = layer.run(int(e), x) * paddle.gather(flat_weights, paddle.to_tensor(assignments)).unsqueeze(-1)
            out = paddle.index_add(out, tokens, 0, y)
        return out
