"""Random routed experts in a model's own formats, for timing MoE backends (`backend_timing`).

Why apart: the expert formats a model's MoE layers have are read from its config alone (float, FP8
blocks, a GGUF file's types per layer), before any weight is read, and one layer of random experts
in each is enough to compare two backends' speed: the values do not change it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fdplug.core.model.checkpoint.gguf_weights import GGUF
from fdplug.core.model.checkpoint.quant_config import fused_quant
from fdplug.plugin_api.gguf_formats import row_bytes

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class ExpertFormat:
    """One MoE layer's expert format: ``none`` (float, the compute dtype), ``fp8_block`` (with its
    ``block``) or ``gguf`` (``qtypes``: the GGML type of gate, up and down)."""

    format: str = "none"
    block: tuple[int, int] = (128, 128)
    qtypes: tuple[tuple[str, str], ...] = ()

    def expert_bytes(self, cfg: Any, dtype_bytes: int) -> int:
        """One expert's bytes in this format."""
        inter, hidden = cfg.moe.intermediate_size, cfg.hidden_size
        if self.format == GGUF:
            types = dict(self.qtypes)
            return inter * (row_bytes(types["gate"], hidden) + row_bytes(types["up"], hidden)) + \
                hidden * row_bytes(types["down"], inter)
        return 3 * inter * hidden * (1 if self.format == "fp8_block" else dtype_bytes)

    def describe(self, cfg: Any, dtype: str, budget: int) -> str:
        types = dict(self.qtypes)
        kind = {"none": dtype, "fp8_block": f"fp8 blocks of {self.block}"}.get(self.format) or \
            "GGUF " + ", ".join(f"{name} {types[name]}" for name in ("gate", "up", "down"))
        moe = cfg.moe
        return (f"{timed_experts(cfg, self, dtype, budget)} of {moe.num_experts} experts x [{moe.intermediate_size}, "
                f"{cfg.hidden_size}], top {moe.routing.top_k}, {kind}")


def expert_formats(cfg: Any) -> list[ExpertFormat]:
    """The distinct expert formats of ``cfg``'s MoE layers, in layer order (the text experts: a
    vision-language model's modality experts run the same backend)."""
    found: list[ExpertFormat] = []
    for layer in cfg.moe.layers:
        prefix = f"model.layers.{layer}.mlp.experts."
        quant = cfg.quant
        if getattr(quant, "format", None) == GGUF:
            fmt = ExpertFormat(GGUF, qtypes=tuple(sorted(quant.expert_types(prefix).items()))) \
                if quant.expert_format == GGUF else ExpertFormat()
        else:
            q = fused_quant(quant, prefix, _PROJECTIONS)
            fmt = ExpertFormat(q.format, block=tuple(q.block)) if q is not None else ExpertFormat()
        if fmt not in found:
            found.append(fmt)
    return found


def timed_experts(cfg: Any, fmt: ExpertFormat, dtype: str, budget: int) -> int:
    """How many experts a timing loads: all that ``budget`` bytes hold, at least the top-k."""
    size = fmt.expert_bytes(cfg, 2 if dtype in ("bfloat16", "float16") else 4)
    return min(cfg.moe.num_experts, max(cfg.moe.routing.top_k, budget // max(size, 1)))


def experts_call(backend: Any, cfg: Any, fmt: ExpertFormat, dtype: str, budget: int, rng: Any) -> Any:
    """``backend`` loaded with one layer of random experts in ``fmt``; -> ``tokens -> call``: one
    ``forward`` of that many random tokens, each routed to the top-k of random distinct experts."""
    import numpy as np
    import paddle

    experts = timed_experts(cfg, fmt, dtype, budget)
    layer = backend.load_weights(_weights(cfg, fmt, dtype, experts, rng))
    top_k = cfg.moe.routing.top_k

    def call(tokens: int) -> Any:
        hidden = paddle.to_tensor(rng.standard_normal((tokens, cfg.hidden_size), dtype=np.float32)).astype(dtype)
        ids = paddle.to_tensor(np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int64))
        weights = rng.random((tokens, top_k), dtype=np.float32) + 0.1
        weights = paddle.to_tensor(weights / weights.sum(axis=1, keepdims=True))
        return lambda: backend.forward(hidden, weights, ids, layer)
    return call


def _weights(cfg: Any, fmt: ExpertFormat, dtype: str, experts: int, rng: Any) -> Any:
    import numpy as np
    import paddle

    from fdplug.plugin_api.moe import ExpertWeights

    inter, hidden = cfg.moe.intermediate_size, cfg.hidden_size
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    if fmt.format == GGUF:
        from fdplug.core.quant.gguf_blocks import sample_blocks

        types = dict(fmt.qtypes)
        stacks = {name: paddle.to_tensor(sample_blocks(types[name], experts * rows, cols, rng)
                                         .reshape(experts, rows, -1)) for name, (rows, cols) in shapes.items()}
        return ExpertWeights(**stacks, format=GGUF, qtypes=types)
    values = {name: paddle.to_tensor(rng.standard_normal((experts, rows, cols), dtype=np.float32) * cols ** -0.5)
              for name, (rows, cols) in shapes.items()}
    if fmt.format != "fp8_block":
        return ExpertWeights(**{name: v.astype(dtype) for name, v in values.items()})
    from fdplug.core.quant.fp8_rows import expand_scale_rows
    from fdplug.plugin_api.fp8 import block_quant

    quantized = {name: block_quant(v, fmt.block) for name, v in values.items()}
    return ExpertWeights(**{name: q for name, (q, _) in quantized.items()}, format="fp8_block", block=fmt.block,
                         scales={name: expand_scale_rows(grid, shapes[name][0], fmt.block[0])
                                 for name, (_, grid) in quantized.items()})
