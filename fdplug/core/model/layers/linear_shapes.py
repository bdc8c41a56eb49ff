"""The model's float linear layers, from its config alone: the shapes the ``linear`` op will be given.

Why: selection that measures (`fdplug.core.worker.op_timing`) times a kernel on the
model's own layer shapes before the weights are read, and `fdplug explain --model DIR` shows
those figures without loading anything. The decoder (`decoder.py`, `layers.py`, `moe_block.py`)
builds exactly these `layers.Linear` layers (tests/test_op_timing.py checks it on built models):
the fused q/k/v and the o projection of every layer, the fused gate/up and the down projection of
each dense MLP or shared expert, and the lm_head, unless the checkpoint keeps a projection in
FP8 (those run ``fp8_linear``) or in a GGUF file's blocks (``gguf_linear``). The routed experts are the MoE backend's,
not the ``linear`` op's.
"""

from __future__ import annotations

from dataclasses import dataclass

from fdplug.core.model.checkpoint.config import ModelConfig
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


def linear_shapes(cfg: ModelConfig, dtype: str) -> list[LinearShape]:
    """Every distinct shape of ``cfg``'s float linear layers (``dtype``: the compute dtype; after
    `ModelConfig.keep_weights`, which says whether they are kept bf16), in the decoder's order."""
    weights = "bfloat16" if cfg.bf16_weights else dtype
    found: dict[tuple[int, int, str, bool, bool], list[str]] = {}   # LinearShape.key -> layer names

    def add(name: str, out_features: int, in_features: int, prepared: bool = True, logits: bool = False) -> None:
        names = found.setdefault((out_features, in_features, weights, prepared, logits), [])
        if name not in names:
            names.append(name)

    moe_layers = set(cfg.moe.layers) if cfg.moe else set()
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    for i in range(cfg.num_layers):
        attn = f"model.layers.{i}.self_attn."
        if fused_quant(cfg.quant, attn, ("q_proj", "k_proj", "v_proj")) is None:
            add("qkv_proj", qkv, cfg.hidden_size)
        if fused_quant(cfg.quant, attn, ("o_proj",)) is None:
            add("o_proj", cfg.hidden_size, cfg.num_heads * cfg.head_dim)
        if i in moe_layers:
            width = cfg.moe.shared_intermediate_size
            prefix, name = shared_expert_prefix(f"model.layers.{i}.", cfg.moe.shared_gate), "shared_expert."
        else:
            width, prefix, name = cfg.intermediate_size, f"model.layers.{i}.mlp.", ""
        if width:
            gate_up, down = mlp_quant(cfg.quant, prefix)
            if gate_up is None:
                add(name + "gate_up_proj", 2 * width, cfg.hidden_size)
            if down is None:
                add(name + "down_proj", cfg.hidden_size, width)
    if not _head_in_blocks(cfg):
        add("lm_head", cfg.vocab_size, cfg.hidden_size, prepared=not cfg.tie_word_embeddings, logits=True)
    return [LinearShape(n, k, w, prepared, logits, tuple(names))
            for (n, k, w, prepared, logits), names in found.items()]


def _head_in_blocks(cfg: ModelConfig) -> bool:
    """A GGUF file's lm_head (or the embedding it is tied to) kept in GGML blocks: ``gguf_linear``'s."""
    if cfg.gguf is None:
        return False
    if cfg.tie_word_embeddings:
        return cfg.gguf.embedding_type is not None
    return fused_quant(cfg.gguf, "", ("lm_head",)) is not None
