"""Op kernels: the seam for a device plugin that has a faster kernel for one op of the model.

The portable model (`fdplug.core.model`) calls these ops through a `Kernels` table built once at
startup from the selected `OpSpec` of each op. The core registers a plain-Paddle implementation of
every op for every device (`fdplug.core.portable.ops`); a device plugin registers its own with a
higher priority, e.g. the cpu plugin's compiled SwiGLU. No runner subclass, no patching after load.

Contracts (``T`` tokens as rows; inputs are never modified; results in the input's dtype):

``swiglu(x) -> y``
    ``x [T, 2*I]`` -> ``y [T, I]`` with ``y = silu(x[:, :I]) * x[:, I:]`` (``paddle.nn.functional.swiglu``).
``rms_norm(x, weight, eps) -> y``
    ``x [..., D]``, ``weight`` broadcast over the trailing axes of ``x`` -> ``weight * x / rms(x)``,
    with ``rms`` computed in float32 over the last axis and the result cast back before the weight
    (as Hugging Face does).
``fp8_linear(x, weight, weight_scale, block_k) -> y``
    ``x [..., K]``, ``weight [N, K]`` float8_e4m3fn, ``weight_scale [N, ceil(K / block_k)]`` float32 (per-row
    block scales, `fdplug.core.model.layers.fp8_linear`) -> ``y [..., N] = x @ (weight * scale)^T`` (no bias).
    A kernel may keep the weights one byte each; it must not change them. One registered with
    ``OpSpec(prepare=...)`` gets its `PreparedWeight` as ``weight`` (as for ``linear``).
``linear(x, weight) -> y``
    ``x [..., K]``, ``weight [N, K]`` (the checkpoint's layout) in ``x``'s dtype or bfloat16 ->
    ``y [..., N] = x @ weight^T`` in ``x``'s dtype and arithmetic (no bias: the layer adds it). Every
    float linear layer and the lm_head. bf16 weights with float32 ``x`` are how a device that
    computes in float32 keeps a bf16 model at 2 bytes a weight; the widening is exact, so the result
    is the float32 model's on the same (bf16) weights. A kernel registered with
    ``OpSpec(bf16_inputs=True)`` instead rounds ``x`` to bf16 when the weights are bf16 (bf16 x bf16
    products, exact in float32, summed in float32): the result is the portable op's on ``bf16(x)``.
    A kernel registered with ``OpSpec(prepare=...)`` lays out each linear layer's weight its own way
    once at load: it then receives that `PreparedWeight` as ``weight`` (and still takes plain
    ``[N, K]`` tensors: the tied lm_head is the embedding table, which stays as it is), and adds
    the layer's bias it carries (``PreparedWeight.bias``).

``add_rms_norm(x, residual, weight, eps) -> (y, total)``
    ``total = x + residual`` (same shapes ``[..., D]``) and ``y = rms_norm(total, weight, eps)``: the
    pre-norm block's residual add and the next norm in one op (vLLM's fused_add_rms_norm, without
    writing into its inputs). The decoder calls it twice a layer; it is where an eager step's small
    ops add up (each runs with caches the weights just streamed through).
``rope(x, cos, sin) -> y``
    ``x``, ``cos``, ``sin`` all ``[T, heads, D]`` (``D`` even; the tables as
    ``layers.RotaryEmbedding.lookup`` gives them: each token's row tiled over the heads, ``sin``'s
    first half negated) -> ``y = x * cos + roll(x, D / 2, axis=-1) * sin``, each product rounded, then
    the sum (NeoX rotation; no fused multiply-add, so a kernel can match the portable op's bits).
``gguf_linear(x, weight, qtype, k) -> y``
    ``x [..., K]`` (``K == k``), ``weight [N, row_bytes]`` uint8: each row ``K`` weights in GGML's
    blocks of type ``qtype`` (a name of `fdplug.plugin_api.gguf_formats.BLOCK_FORMATS`: ``Q4_1``,
    ``Q6_K``...; byte for byte as the GGUF file stores them) -> ``y [..., N] = x @ dequantize(weight)^T``
    in ``x``'s dtype and arithmetic (no bias). Every linear layer of a GGUF model whose weights are
    quantized (and the tied lm_head of a quantized embedding). A kernel reads the blocks in place or
    lays them out once at load (``OpSpec(prepare=...)``, the `PreparedWeight` keeping the same bytes);
    it must not requantize them. A kernel supports the types listed in ``ModelTraits.weight_types``
    or objects in ``supports``. One registered with ``OpSpec(bf16_inputs=True)`` rounds ``x`` and each
    decoded weight to bf16 and sums the (exact) products in float32: the portable op's result on
    ``bf16(x)`` and ``bf16(dequantize(weight))``. One registered with ``OpSpec(q8_inputs=True)``
    quantizes ``x`` to 8 bits per 4 values (``q8_inputs=16``: per 16; API 4.4;
    `fdplug.plugin_api.gguf_formats.q8_inputs`) for the quantized block types: the portable op's
    result on those values, up to float32 rounding (F16 and BF16 rows as without it). A model whose
    lm_head is its GGUF embedding table hands the lm_head the table as ``prepare`` laid it out (a copy
    beside the table the embedding reads; API 4.8: where that `PreparedWeight` has ``rows``, the
    embedding reads them and the model drops the file's table), or the table itself.
``argmax(logits) -> ids``
    ``logits [T, V]`` float32 -> numpy int64 ``[T]``: each row's largest value's index, the lowest
    among equal values, NaN never chosen (a row of only NaN gives 0); greedy sampling. On the host:
    the sampler continues there.
``decoder_stack(stack) -> run | reason``
    Called once after load with a `fdplug.plugin_api.decoder_stack.DecoderStack` (every decoder layer of
    a dense model: weights, shapes, the selected ops and attention backend). Returns a str saying
    why it declines (logged; the model then runs layer by layer with the ops above, which is what
    the portable op always does), or ``run(input_ids, hidden, cos, sin, kv_caches, prepared) -> (x,
    residual) | None``: every layer of one step in one call, from the embeddings ``hidden [T,
    hidden_size]`` (None where ``run.embeds`` is true and the step has no multimodal rows: the run
    reads ``input_ids``' rows of ``stack.embedding`` itself), the RoPE tables ``[T, H + KV, D]``,
    each layer's ``(key_cache, value_cache)`` and the attention backend's ``prepare`` of the step, to
    the last layer's MLP output and residual stream (the model adds them in its final norm). ``run``
    writes the cache as the layers would and returns what they return with the selected ops and
    backend (a kernel fusing its own ops compares bits; the conformance tolerance is the ops'), or
    None to decline that step (a step it does not run: prefill, another backend's metadata) before
    writing anything.

``vision_attention(q, k, v, bounds, scale) -> out``
    ``q``, ``k``, ``v`` ``[N, heads, D]`` (a vision tower's patches, RoPE applied), ``bounds`` a numpy
    int64 array ``[0, ..., N]`` of segment boundaries (a tower's windows, or its frames) ->
    ``out [N, heads, D]``: each token's softmax(q k^T * scale) v over the tokens of its own segment
    (bidirectional, no cache). The vision encoder's attention (`fdplug.core.vision`).

A kernel must agree with the portable implementation to float32 rounding (relative 1e-5); the
conformance kit (`fdplug.testing`) checks every registered op against it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OPS: tuple[str, ...] = ("swiglu", "rms_norm", "fp8_linear", "linear", "add_rms_norm", "rope", "argmax",
                        "gguf_linear", "decoder_stack", "vision_attention")
"""Every op a plugin may override, in the order `Kernels` lists them."""
PREPARED_OPS: tuple[str, ...] = ("linear", "fp8_linear", "gguf_linear")
"""The ops whose kernels may lay out the layers' weights once at load (`OpSpec.prepare`)."""
MEASURED_OPS: tuple[str, ...] = ("linear", "fp8_linear", "gguf_linear", "rms_norm", "add_rms_norm", "rope", "swiglu",
                                  "argmax", "decoder_stack")
"""The ops whose kernels may be timed against the portable op at startup (`OpSpec.measure_key`):
the linears (``linear``, ``fp8_linear``, ``gguf_linear``) per layer shape, the row ops per op, a
``decoder_stack`` on the loaded model's decode steps against its layers one by one."""


@dataclass(slots=True)
class PreparedWeight:
    """A linear layer's weight in one kernel's own layout, made once at load (`OpSpec.prepare`).

    Why: a kernel whose tiles want the weights in another order (panels of columns, k-major, as
    BLAS libraries pack them on every call) pays for the reordering once instead of every step,
    and the layer keeps one copy. ``data`` holds the same values in that order, same dtype, same
    element count (the layer keeps it as its ``weight`` parameter, so footprints still add up);
    ``shape`` is the logical ``[N, K]``; ``layout`` names the order, checked by the kernel that
    reads it (a weight prepared for one kernel is never read by another as ``[N, K]``).
    """

    data: Any
    shape: tuple[int, int]
    layout: str
    bias: Any = None
    """The layer's bias ``[N]`` (None: none): a kernel handed a `PreparedWeight` adds it itself (in
    its output store: one op less a layer, the same float addition)."""
    rows: Callable[[Any], Any] | None = None
    """API 4.8, optional: ``rows(ids)`` -> ``[T, K]`` float32, the rows ``ids`` (int64 ``[T]``, each in
    ``[0, N)``) of the logical ``[N, K]`` weight with the portable op's values (a GGUF table: what
    ``gguf_blocks.dequantize`` gives the file's rows, bit for bit). A tied lm_head's table prepared
    with it is the only copy the model keeps: the embedding reads its token rows here."""

    @property
    def dtype(self) -> Any:
        return self.data.dtype


@dataclass(frozen=True, slots=True)
class Kernels:
    """The op implementations the model calls: one callable per name in `OPS`, and the selected
    ``linear``, ``fp8_linear`` and ``gguf_linear`` kernels' weight preparation (`OpSpec.prepare`;
    None: weights stay ``[N, K]``; ``gguf_linear``'s also gets the layer's block type)."""

    swiglu: Callable[[Any], Any]
    rms_norm: Callable[[Any, Any, float], Any]
    fp8_linear: Callable[[Any, Any, Any, int], Any]
    linear: Callable[[Any, Any], Any]
    add_rms_norm: Callable[[Any, Any, Any, float], tuple[Any, Any]]
    rope: Callable[[Any, Any, Any], Any]
    argmax: Callable[[Any], Any]
    gguf_linear: Callable[[Any, Any, str, int], Any]
    decoder_stack: Callable[[Any], Callable[..., tuple[Any, Any] | None] | str]
    vision_attention: Callable[[Any, Any, Any, Any, float], Any]
    prepare_linear: Callable[[Any], PreparedWeight | None] | None = None
    prepare_fp8_linear: Callable[[Any], PreparedWeight | None] | None = None
    prepare_gguf_linear: Callable[[Any, str], PreparedWeight | None] | None = None
