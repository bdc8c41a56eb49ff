"""What the ``decoder_stack`` op (`fdplug.plugin_api.ops`) is handed: a dense model's decoder layers.

Why: in a decode step of a small model most of the time is spent between kernels (an eager
framework's per-op cost, ~12 ops a layer), not in them. A device that can run every layer of a step
in one call of its own (a compiled loop, a captured graph) needs the weights and shapes of all of
them once, at load; this is that description, made by the core from the loaded model. It holds the
layers' own tensors (nothing is copied) in the model's layout:

- ``qkv`` projects ``[T, hidden]`` to ``[T, (H + 2 KV) * D]``: the q heads, then k, then v;
- an optional per-head ``qk_norm`` (Qwen3) over the ``H + KV`` q and k heads, then NeoX RoPE with the
  step's ``cos``/``sin`` tables (``[T, H + KV, D]``, as the ``rope`` op gets them);
- attention of the q heads over the cache after k and v are written, ``o`` back to ``hidden``;
- pre-norm residual blocks, ``gate_up`` then SwiGLU then ``down``, as `fdplug.core.model.layers.decoder`
  computes them.

Which linear formats a plugin runs is its own choice: it declines what it does not (and says why).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class StackLinear:
    """One linear layer ``y = x @ W^T (+ bias)`` of ``in_features`` to ``out_features``.

    ``format`` ``"gguf"``: ``groups`` are ``(weight, qtype)`` row groups in output order, each
    ``uint8 [rows, row_bytes]`` in GGML blocks of ``qtype`` (the ``gguf_linear`` op's weights, or what
    its kernel's ``prepare`` made of them); ``"float"``: one group ``(weight, dtype)``, the ``linear``
    op's weight ``[N, K]`` (or its `PreparedWeight`). A model with FP8 linears is not described at
    all (the core logs why and runs its layers one by one).
    """

    format: str
    groups: tuple[tuple[Any, str], ...]
    in_features: int
    out_features: int
    bias: Any = None

    def group_rows(self) -> tuple[int, ...]:
        """Each group's output rows (a `PreparedWeight` keeps its logical shape)."""
        return tuple(int(getattr(w, "shape", [0])[0]) for w, _ in self.groups)


@dataclass(frozen=True, slots=True)
class StackLayer:
    """One decoder layer: its two norms' weights ``[hidden]``, the q/k norm's ``[H + KV, D]`` (or None)
    and its four linear layers."""

    input_norm: Any
    post_norm: Any
    qkv: StackLinear
    o: StackLinear
    gate_up: StackLinear
    down: StackLinear
    qk_norm: Any = None


@dataclass(frozen=True, slots=True)
class DecoderStack:
    """Every decoder layer of a dense model (a MoE model is not described), and what a fused run
    must agree with: ``ops`` maps every op to the kernel selected for it (`OpSpec` names) and
    ``attention`` names the selected backend. A stack that fuses its own kernels declines where
    another was chosen (a user's ``--op-kernel``), so a choice is never silently replaced."""

    layers: tuple[StackLayer, ...]
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_scale: float
    dtype: str
    ops: Mapping[str, str]
    attention: str
    embedding: StackLinear | None = None
    """The token embedding table ``[vocab, hidden]`` as a "linear" of ``hidden`` inputs (a GGUF
    file's blocks, or float rows; API 4.8: or, for a tied lm_head whose prepared table gives its
    rows back, that `PreparedWeight`, the model's only copy): a stack that reads its rows itself
    says so (``run.embeds``)."""
