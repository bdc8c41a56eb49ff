"""One decoder for Llama, Qwen2, Qwen3, ERNIE-4.5 and their MoE variants: the differences are config flags.

Per layer a step is a handful of ops: (residual add +) RMSNorm, one fused q/k/v matmul, (Qwen3)
one RMSNorm over the stacked q and k heads, one RoPE over them, the attention backend, the output
projection, residual add + RMSNorm, one fused gate/up matmul, SwiGLU, the down projection (in a MoE
layer, `moe_block.SparseMoEBlock` instead: router, routing rule, the selected MoE backend). Norms,
RoPE, SwiGLU and the linears run the op kernels chosen at startup (`fdplug.plugin_api.ops`); the
residual adds run inside the norms (``add_rms_norm``). Tokens of every sequence in the step are flat
rows; the attention backend (chosen at startup) owns the KV cache layout and the masking.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import paddle
import paddle.nn.functional as F
from paddle import nn

from fdplug.core.model.checkpoint.config import ModelConfig
from fdplug.core.model.checkpoint.quant_config import fused_quant, mlp_quant
from fdplug.core.model.layers.basic import MRotaryEmbedding, RMSNorm, RotaryEmbedding, SwiGLU, make_linear
from fdplug.core.model.layers.gguf_linear import embedding_rows
from fdplug.core.model.layers.linear import Linear, empty_parameter
from fdplug.core.model.layers.modality_moe import ModalityMoE
from fdplug.core.model.layers.moe_block import SparseMoEBlock
from fdplug.core.portable.ops import PORTABLE
from fdplug.plugin_api.ops import Kernels


class Attention(nn.Layer):
    """GQA self-attention; q/k/v come out of one ``[hidden, (H + 2*KV) * D]`` matmul."""

    def __init__(self, cfg: ModelConfig, attn_backend: Any, dtype: str, kernels: Kernels, prefix: str = "") -> None:
        """``prefix``: the layer's HF name (``model.layers.0.``), which says which projections are FP8."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.backend = attn_backend
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        attn = prefix + "self_attn."
        self.qkv_proj = make_linear(cfg.hidden_size, qkv_out, cfg.attention_bias, dtype,
                                    fused_quant(cfg.quant, attn, ("q_proj", "k_proj", "v_proj")), kernels,
                                    cfg.bf16_weights)
        self.o_proj = make_linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, dtype,
                                  fused_quant(cfg.quant, attn, ("o_proj",)), kernels, cfg.bf16_weights)
        # Qwen3: q_norm's weight on each q head, k_norm's on each k head -> one norm for both.
        self.qk_norm = (RMSNorm([cfg.num_heads + cfg.num_kv_heads, cfg.head_dim], cfg.rms_norm_eps, dtype, kernels)
                        if cfg.qk_norm else None)

    def forward(self, x: Any, cos: Any, sin: Any, rope: RotaryEmbedding, kv_cache: tuple[Any, Any],
                prepared: Any) -> Any:
        qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).reshape([0, qk_heads + self.num_kv_heads, self.head_dim])
        qk, v = paddle.split(qkv, [qk_heads, self.num_kv_heads], axis=1)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        q, k = paddle.split(rope(qk, cos, sin), [self.num_heads, self.num_kv_heads], axis=1)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], prepared, self.scale)
        return self.o_proj(out.reshape([0, self.num_heads * self.head_dim]))


class DecoderLayer(nn.Layer):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, attn_backend: Any, dtype: str, kernels: Kernels,
                 moe_backend: Any | None = None, index: int = 0, expert_parallel: Any = None) -> None:
        super().__init__()
        prefix = f"model.layers.{index}."
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        self.self_attn = Attention(cfg, attn_backend, dtype, kernels, prefix)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        if moe_backend is not None and cfg.moe.vision is not None:
            self.mlp = ModalityMoE(cfg.hidden_size, cfg.moe, moe_backend, dtype, kernels, cfg.mlp_bias, prefix,
                                   cfg.bf16_weights)
        elif moe_backend is not None:
            self.mlp = SparseMoEBlock(cfg.hidden_size, cfg.moe, moe_backend, dtype, kernels, cfg.quant, prefix,
                                      cfg.bf16_weights, expert_parallel)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, kernels,
                              mlp_quant(cfg.quant, prefix + "mlp."), cfg.bf16_weights)

    def forward(self, x: Any, residual: Any | None, cos: Any, sin: Any, rope: RotaryEmbedding,
                kv_cache: tuple[Any, Any], prepared: Any, modality_rows: Any = None) -> tuple[Any, Any]:
        """``x``: the previous block's output, ``residual``: the stream it adds to (None before the
        first layer: ``x`` is the embedding) -> this layer's MLP output and the stream before it.

        Carrying the pair lets every residual add run inside the next norm (``add_rms_norm``); the
        sums are the same float additions as ``x + f(norm(x))``.
        """
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h = self.self_attn(h, cos, sin, rope, kv_cache, prepared)
        h, residual = self.post_attention_layernorm.add(h, residual)
        return (self.mlp(h, modality_rows) if isinstance(self.mlp, ModalityMoE) else self.mlp(h)), residual


class DecoderForCausalLM(nn.Layer):
    """The whole model. ``forward`` gives final hidden states; ``compute_logits`` the vocab scores.

    Splitting the two lets the runner compute logits only for the rows it samples from (the last
    token of each sequence), which on a long prefill is most of the lm_head's cost saved.

    ``fused_stack``: what the ``decoder_stack`` op made of the layers (`fused_stack.attach`), which
    runs every layer of the steps it takes in one call; None: the layers run one by one.
    """

    fused_stack: Any = None

    def __init__(self, cfg: ModelConfig, attn_backend: Any, dtype: str = "float32",
                 max_positions: int | None = None, kernels: Kernels = PORTABLE, moe_backend: Any | None = None,
                 expert_parallel: Any = None) -> None:
        """``moe_backend`` runs the routed experts of MoE layers (default: the portable reference);
        ``expert_parallel`` (a `lockstep.LockstepGroup`): this rank holds its share of them, and
        every forward pass is one of the group's lockstep passes."""
        super().__init__()
        self.config = cfg
        self.dtype_name = dtype
        self.logits_kernel = kernels.linear       # the lm_head is a linear of [vocab, hidden] weights
        table_dtype = "bfloat16" if cfg.bf16_weights else dtype   # the embedding is the tied lm_head
        self.embed_type = cfg.gguf.embedding_type if cfg.gguf else None
        if self.embed_type is not None:   # a GGUF file's table stays in its blocks (`gguf_layers`)
            from fdplug.plugin_api.gguf_formats import row_bytes

            self.gguf_kernel = kernels.gguf_linear
            self.head_weight: Any = None   # the tied lm_head's table as the kernel prepared it (`prepare_tied_head`)
            self.embed_tokens = empty_parameter([cfg.vocab_size, row_bytes(self.embed_type, cfg.hidden_size)],
                                                "uint8")
        else:
            self.embed_tokens = empty_parameter([cfg.vocab_size, cfg.hidden_size], table_dtype)
        moe_layers = set(cfg.moe.layers) if cfg.moe else set()
        if moe_layers and moe_backend is None:
            from fdplug.core.portable.moe import ReferenceMoE

            moe_backend = ReferenceMoE()
        self.expert_parallel = expert_parallel if moe_layers else None
        if self.expert_parallel is not None:
            self.expert_parallel.attach(moe_backend, cfg.moe.num_experts)
        self.layers = nn.LayerList([DecoderLayer(cfg, attn_backend, dtype, kernels,
                                                 moe_backend if i in moe_layers else None, i, self.expert_parallel)
                                    for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        # [vocab, hidden] like the embedding, so tying is sharing one tensor; untied, a Linear (its
        # kernel may lay the weights out its own way at load, `Linear.prepare`).
        head_quant = fused_quant(cfg.gguf, "", ("lm_head",))    # FP8 checkpoints keep a float lm_head
        self.lm_head = (None if cfg.tie_word_embeddings
                        else make_linear(cfg.hidden_size, cfg.vocab_size, False, dtype, head_quant, kernels)
                        if head_quant is not None
                        else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, kernels.linear, table_dtype))
        rotary = MRotaryEmbedding if cfg.rope.mrope_section else RotaryEmbedding
        self.rotary = rotary(cfg.rope, cfg.head_dim, max_positions or cfg.max_position_embeddings, dtype,
                                      heads=cfg.num_heads + cfg.num_kv_heads, kernels=kernels)  # q, k together
        self.eval()

    def prepare_tied_head(self, prepare: Callable[[Any, str], Any]) -> None:
        """A GGUF model whose lm_head is its embedding table: the ``gguf_linear`` kernel's layout of the
        table for the lm_head (`OpSpec.prepare`). Where that layout gives its rows back
        (`PreparedWeight.rows`) the embedding reads them there and the file's table is dropped: one
        copy. Else it stays beside the copy for the embedding."""
        if self.embed_type is None or self.lm_head is not None or self.head_weight is not None:
            return
        self.head_weight = prepare(self.embed_tokens, self.embed_type)
        if self.head_weight is not None and self.head_weight.rows is not None:
            self.embed_tokens = None   # (`embed` and the fused stack read the prepared copy)

    def head_copy_bytes(self) -> int:
        """Bytes of the tied table as `prepare_tied_head` laid it out: held, but not a parameter."""
        head = getattr(self, "head_weight", None)   # (only a GGUF model's table has one)
        return 0 if head is None else int(head.data.numel()) * head.data.element_size()

    def embedding_table(self) -> Any:
        """The table the embedding reads: the file's, or the lm_head's laid-out copy (a
        `PreparedWeight`) once `prepare_tied_head` dropped the file's."""
        return self.head_weight if self.embed_tokens is None else self.embed_tokens

    def embed(self, input_ids: Any) -> Any:
        """Token embeddings ``[T, hidden]``; multimodal code replaces rows before ``forward``."""
        if self.embed_type is not None and self.embed_tokens is None:   # (`prepare_tied_head`)
            rows = self.head_weight.rows(input_ids)
            return rows if self.dtype_name == "float32" else rows.astype(self.dtype_name)
        if self.embed_type is not None:
            return embedding_rows(self.embed_tokens, self.embed_type, self.config.hidden_size, input_ids,
                                  self.dtype_name)
        h = F.embedding(input_ids, self.embed_tokens)
        return h.astype(self.dtype_name) if self.config.bf16_weights else h

    def forward(self, input_ids: Any, positions: Any, kv_caches: list[tuple[Any, Any]], attn_prepared: Any,
                inputs_embeds: Any | None = None, modality_rows: Any = None) -> Any:
        """``input_ids [T]``, ``positions [T]`` (int64; ``[3, T]`` with multimodal RoPE) -> final hidden
        states ``[T, hidden]``.

        ``kv_caches[i]`` is layer ``i``'s ``(key_cache, value_cache)`` in the backend's layout;
        ``attn_prepared`` is ``backend.prepare(meta)`` for this step. ``modality_rows``: the text and
        the vision rows of a model with modality experts (`modality_moe.ModalityMoE`).
        """
        if self.expert_parallel is None:
            return self._forward(input_ids, positions, kv_caches, attn_prepared, inputs_embeds, modality_rows)
        with self.expert_parallel.forward_pass(int((input_ids if inputs_embeds is None else inputs_embeds).shape[0])):
            return self._forward(input_ids, positions, kv_caches, attn_prepared, inputs_embeds, modality_rows)

    def _forward(self, input_ids: Any, positions: Any, kv_caches: list[tuple[Any, Any]], attn_prepared: Any,
                 inputs_embeds: Any | None, modality_rows: Any = None) -> Any:
        cos, sin = self.rotary.lookup(positions)
        h = inputs_embeds
        if self.fused_stack is not None:
            if h is None and not self.fused_stack.embeds:
                h = self.embed(input_ids)
            fused = self.fused_stack(input_ids, h, cos, sin, kv_caches, attn_prepared)
            if fused is not None:
                return self.norm.add(*fused)[0]
        h = self.embed(input_ids) if h is None else h
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, cos, sin, self.rotary, kv_cache, attn_prepared, modality_rows)
        return self.norm(h) if residual is None else self.norm.add(h, residual)[0]

    def compute_logits(self, hidden: Any) -> Any:
        """``hidden [N, hidden]`` -> logits ``[N, vocab]`` in float32."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self.embed_type is not None:
            table = self.embed_tokens if self.head_weight is None else self.head_weight
            logits = self.gguf_kernel(hidden, table, self.embed_type, self.config.hidden_size)
        else:
            logits = self.logits_kernel(hidden, self.embed_tokens)
        return logits if logits.dtype == paddle.float32 else logits.astype("float32")
