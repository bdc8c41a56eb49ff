"""The model's linear layers, from its config alone: the shapes the ``linear``, ``fp8_linear`` and
``gguf_linear`` ops will be given.

Why: selection that measures (`fdplug.core.worker.op_timing`) times a kernel on the
model's own layer shapes before the weights are read, and `fdplug explain --model DIR` shows
those figures without loading anything. The decoder (`decoder.py`, `layers.py`, `moe_block.py`)
builds exactly these layers (tests/test_op_timing.py checks it on built models): the fused q/k/v
and the o projection of every layer, the fused gate/up and the down projection of each dense MLP or
shared expert, and the lm_head; a float one is a `layers.Linear` (``linear``), one kept in FP8
blocks an `Fp8Linear` (``fp8_linear``; FP8 checkpoints keep a float lm_head), one in a GGUF file's
blocks a `GgufLinear` (``gguf_linear``, one call per block type). The routed experts are the MoE
backend's, not these ops'.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fdplug.core.model.checkpoint.config import ModelConfig
from fdplug.core.model.checkpoint.gguf_weights import GgufLayout
from fdplug.core.model.checkpoint.quant_config import fused_quant, mlp_quant, shared_expert_prefix


@dataclass(frozen=True, slots=True)
class LinearShape:
    """One shape of ``linear`` weights ``[out_features, in_features]`` and the layers that have it."""

    out_features: int
    in_features: int
    weight_dtype: str
    prepared: bool
    """The kernel may lay the weight out its own way at load (`layers.Linear.prepare`); False for
    the tied lm_head, which is the embedding table and stays ``[vocab, hidden]``."""
    logits: bool
    """The lm_head: it runs on the sampled rows only (one a sequence), never a prefill's."""
    layers: tuple[str, ...]

    @property
    def key(self) -> tuple[int, int, str, bool, bool]:
        """What a kernel's speed on it depends on (the layers' names do not)."""
        return self.out_features, self.in_features, self.weight_dtype, self.prepared, self.logits

    def describe(self) -> str:
        kind = "" if self.prepared else ", in place"
        return f"[{self.out_features}, {self.in_features}] {self.weight_dtype}{kind} ({', '.join(self.layers)})"


def linear_shapes(cfg: ModelConfig, dtype: str, op: str = "linear") -> list[LinearShape]:
    """Every distinct shape ``op`` is given by ``cfg``'s linear layers, in the decoder's order:
    ``linear`` the float ones (``dtype``: the compute dtype; after `ModelConfig.keep_weights`, which
    says whether they are kept bf16), ``fp8_linear`` those kept in FP8 blocks, ``gguf_linear`` those
    in a GGUF file's GGML blocks (one shape per block type of a fused projection: a group is one call,
    `GgufLinear`). ``weight_dtype`` names the format: the float dtype, `fp8_format`, or the GGML type."""
    weights = "bfloat16" if cfg.bf16_weights else dtype
    found: dict[tuple[int, int, str, bool, bool], list[str]] = {}   # LinearShape.key -> layer names

    def add(name: str, out_features: int, in_features: int, fmt: str, prepared: bool = True,
            logits: bool = False) -> None:
        names = found.setdefault((out_features, in_features, fmt, prepared, logits), [])
        if name not in names:
            names.append(name)

    def add_layer(name: str, quant: Any, out_features: int, in_features: int, logits: bool = False) -> None:
        if quant is None:
            if op == "linear":
                add(name, out_features, in_features, weights, logits=logits)
        elif isinstance(quant, GgufLayout):
            if op == "gguf_linear":
                for qtype, rows in quant.groups:
                    add(name, rows, in_features, qtype, logits=logits)
        elif op == "fp8_linear":
            add(name, out_features, in_features, fp8_format(quant.block[1]), logits=logits)

    for name, quant, out_features, in_features in _projections(cfg):
        add_layer(name, quant, out_features, in_features)
    head = fused_quant(cfg.gguf, "", ("lm_head",)) if cfg.gguf is not None and not cfg.tie_word_embeddings else None
    if cfg.tie_word_embeddings and cfg.gguf is not None and cfg.gguf.embedding_type is not None:
        if op == "gguf_linear":   # the table in blocks, laid out again for the kernel (`prepare_tied_head`)
            add("lm_head", cfg.vocab_size, cfg.hidden_size, cfg.gguf.embedding_type, logits=True)
    elif head is not None:
        add_layer("lm_head", head, cfg.vocab_size, cfg.hidden_size, logits=True)
    elif op == "linear":          # FP8 checkpoints keep a float lm_head; a tied one stays [vocab, hidden]
        add("lm_head", cfg.vocab_size, cfg.hidden_size, weights, prepared=not cfg.tie_word_embeddings, logits=True)
    return [LinearShape(n, k, w, prepared, logits, tuple(names))
            for (n, k, w, prepared, logits), names in found.items()]


def fp8_format(block_k: int) -> str:
    """An FP8 layer's `LinearShape.weight_dtype`: the kernels' speed depends on the scales' block too."""
    return f"{_FP8} {block_k}"


def fp8_block_k(weight_dtype: str) -> int:
    """The block of `fp8_format`'s name."""
    return int(weight_dtype.removeprefix(_FP8))


_FP8 = "float8_e4m3fn, k blocks of"


def _projections(cfg: ModelConfig) -> Iterator[tuple[str, Any, int, int]]:
    """``(name, quantization, out_features, in_features)`` of every projection the decoder layers
    build (`fused_quant`: None for a float one, a `QuantConfig` for FP8, a `GgufLayout`)."""
    moe_layers = set(cfg.moe.layers) if cfg.moe else set()
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    for i in range(cfg.num_layers):
        attn = f"model.layers.{i}.self_attn."
        yield "qkv_proj", fused_quant(cfg.quant, attn, ("q_proj", "k_proj", "v_proj")), qkv, cfg.hidden_size
        yield "o_proj", fused_quant(cfg.quant, attn, ("o_proj",)), cfg.hidden_size, cfg.num_heads * cfg.head_dim
        if i in moe_layers:
            width = cfg.moe.shared_intermediate_size
            prefix, name = shared_expert_prefix(f"model.layers.{i}.", cfg.moe.shared_gate), "shared_expert."
        else:
            width, prefix, name = cfg.intermediate_size, f"model.layers.{i}.mlp.", ""
        if width:
            gate_up, down = mlp_quant(cfg.quant, prefix)
            yield name + "gate_up_proj", gate_up, 2 * width, cfg.hidden_size
            yield name + "down_proj", down, cfg.hidden_size, width
