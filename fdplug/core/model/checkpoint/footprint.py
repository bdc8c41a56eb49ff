"""How many bytes a checkpoint's weights take once loaded, from config.json alone.

Known before a byte of weights is read, so a model that cannot fit says so with the numbers
instead of failing halfway through loading; and the KV-cache plan counts the routed experts, which
a MoE backend holds in its own layout (not as model parameters).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fdplug.core.model.checkpoint.config import ModelConfig
from fdplug.plugin_api.model_runner import format_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class WeightFootprint:
    total_bytes: int
    expert_bytes: int          # the routed experts of every MoE layer (part of the total)

    def describe(self, cfg: ModelConfig) -> str:
        if cfg.moe is None:
            return format_bytes(self.total_bytes)
        moe = cfg.moe
        return (f"{format_bytes(self.total_bytes)}, of which the routed experts take {format_bytes(self.expert_bytes)} "
                f"({len(moe.layers)} MoE layers x {moe.num_experts} experts x 3 x {moe.intermediate_size} x "
                f"{cfg.hidden_size})")


def _mlp(hidden: int, inter: int, bias: bool) -> int:
    return 3 * hidden * inter + (2 * inter + hidden if bias else 0)


def parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """``(all parameters, routed-expert parameters)`` of the decoder built for ``cfg``."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    total = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h
    moe = cfg.moe
    for i in range(cfg.num_layers):
        total += h * (q + 2 * kv) + (q + 2 * kv if cfg.attention_bias else 0) + q * h + (h if cfg.o_proj_bias else 0)
        total += 2 * h + ((cfg.num_heads + cfg.num_kv_heads) * d if cfg.qk_norm else 0)
        if moe is None or i not in moe.layers:
            total += _mlp(h, cfg.intermediate_size, cfg.mlp_bias)
            continue
        for part in (moe, moe.vision) if moe.vision is not None else (moe,):   # (modality experts: two sets)
            total += h * part.num_experts + (part.num_experts if part.routing.bias else 0)
            total += part.num_experts * _mlp(h, part.intermediate_size, False)
        total += _mlp(h, moe.shared_intermediate_size, False) if moe.shared_intermediate_size else 0
        total += h if moe.shared_gate else 0
    experts = moe.expert_parameters(h) if moe else 0
    return total, experts


def weight_footprint(cfg: ModelConfig, dtype: str, expert_shards: int = 1) -> WeightFootprint:
    """Bytes of the weights as loaded (``expert_shards``: one rank's share of the routed experts
    under expert parallel); FP8 experts count 1 byte a weight plus their per-row scales
    (`fp8_layers`), a GGUF file's experts their bytes in the file. FP8 dense linears are counted as
    ``dtype``: an upper bound, fine for a fit check; with `ModelConfig.bf16_weights` everything but
    the routed experts counts 2 bytes (the norms and biases, kept in ``dtype``, are a rounding error)."""
    total, experts = parameter_counts(cfg)
    size = DTYPE_BYTES[dtype]
    expert_bytes = experts * size
    dense_size = DTYPE_BYTES["bfloat16"] if cfg.bf16_weights else size
    if cfg.moe is not None and cfg.moe_weight_format() == "gguf":   # the file's blocks
        expert_bytes = cfg.gguf.expert_bytes
    elif cfg.moe is not None and cfg.moe_weight_format() != "none":
        h, i, bk = cfg.hidden_size, cfg.moe.intermediate_size, cfg.quant.block[1]
        scales = 4 * (2 * i * -(-h // bk) + h * -(-i // bk))
        expert_bytes = experts + len(cfg.moe.layers) * cfg.moe.num_experts * scales
    if expert_shards > 1:
        total, experts, expert_bytes = total - experts, 0, expert_bytes // expert_shards
    if cfg.gguf:   # GGML blocks: the file's bytes
        weights, held = cfg.gguf.held
        return WeightFootprint((total - experts - weights) * dense_size + held + expert_bytes, expert_bytes)
    return WeightFootprint((total - experts) * dense_size + expert_bytes, expert_bytes)


def model_summary(cfg: ModelConfig, dtype: str, moe_backend: str, ops: Mapping[str, Any] | None = None) -> str:
    """What `fdplug explain --model` and the startup log say about a model: architecture, dtype,
    weights, for bf16 weights on a float32 device and for a quantized model which kernel runs the
    linears (the selected ``linear`` / ``fp8_linear`` of ``ops``, op name -> `OpSpec`), and for a
    MoE model which backend runs its experts and how tokens are routed."""
    def kernel(op: str) -> str:
        return ops[op].name if ops and op in ops else op

    lines = [f"model: {cfg.architecture}, computed in {dtype}, weights {weight_footprint(cfg, dtype).describe(cfg)}"]
    if cfg.bf16_weights:
        math = (f"linear layers and lm_head in bf16 math, inputs rounded to bf16 and {dtype} sums: {kernel('linear')}"
                if ops and "linear" in ops and ops["linear"].bf16_inputs
                else f"linear layers and lm_head: {kernel('linear')}")
        lines.append(f"weights: bf16, computed in {dtype} ({math}; "
                     f"norms and biases in {dtype}{', routed experts in ' + dtype if cfg.moe else ''})")
    if cfg.quant is not None:
        experts = f"; routed experts: {moe_backend}" if cfg.moe is not None else ""
        op = "gguf_linear" if cfg.gguf else "fp8_linear"
        spec = ops.get(op) if ops else None
        math = (" in bf16 math (inputs and weights rounded to bf16, float32 sums)"
                if spec is not None and spec.bf16_inputs
                else f" in q8 math (inputs quantized to 8 bits per {spec.q8_run} values, integer sums)"
                if spec is not None and spec.q8_inputs else "")
        lines.append(f"quantization: {cfg.quant.describe()} (linear layers{math}: {kernel(op)}{experts})")
    moe = cfg.moe
    if moe is None:
        lines.append("moe: unused (a dense model)")
    else:
        shared = f", shared expert of width {moe.shared_intermediate_size}" if moe.shared_intermediate_size else ""
        vision = (f"; for vision tokens {moe.vision.num_experts} experts of width {moe.vision.intermediate_size}"
                  if moe.vision is not None else "")
        lines.append(f"moe: {moe_backend} runs the routed experts: {moe.num_experts} experts of width "
                     f"{moe.intermediate_size} in layers {list(moe.layers)}, routing {moe.routing.describe()}{shared}"
                     f"{vision}")
    return "\n".join(lines)
