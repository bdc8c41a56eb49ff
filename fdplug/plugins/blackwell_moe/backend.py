"""``blackwell_fp8``: routed experts as two grouped FP8 GEMMs on NVIDIA Blackwell (SM100).

One layer's forward, as DeepSeek-V3-style FP8 MoE runs on Blackwell (DeepGEMM, FastDeploy's and
vLLM's DeepGEMM MoE paths):

1. the tokens' activations quantized per 1x128 group with power-of-two (UE8M0) scales
   (`fdplug.plugin_api.fp8.per_token_group_quant`);
2. their rows laid out per expert (`dispatch`): the *masked* layout (a fixed ``[E, capacity]``
   grid, ``capacity`` = ``num_max_dispatch_tokens_per_rank``) when the step has at most that many
   tokens, as decode steps do, else the *contiguous* layout padded to 128 rows per expert;
3. grouped GEMM with the fused gate/up weights ``[E, 2I, H]``;
4. SwiGLU, then the result quantized again per 1x128 group (`swiglu_quant`);
5. grouped GEMM with the down weights ``[E, H, I]``;
6. each token's k outputs summed with their routing weights (`dispatch.combine`).

A step with no tokens returns an empty ``[0, H]`` without touching a kernel. Scales reach the
kernel in DeepGEMM's SM100 layout, made here (`fdplug.plugin_api.fp8.sm100_weight_scales`):
weights once at load, after re-quantizing float-scale checkpoints to UE8M0 as vLLM does
(`requant_ue8m0`), activations per step. The GEMMs themselves are the `kernels.GroupedFp8Gemm`
given to the backend; everything else is Paddle, tested on the CPU against the portable path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import paddle
import paddle.nn.functional as F

from fdplug.errors import ConfigError
from fdplug.plugin_api.fp8 import (
    ceil_to_ue8m0,
    per_token_group_quant,
    requant_ue8m0,
    sm100_weight_scales,
)
from fdplug.plugin_api.moe import ExpertWeights
from fdplug.plugins.blackwell_moe.dispatch import (
    combine,
    gather_rows,
    plan_contiguous,
    plan_masked,
)
from fdplug.plugins.blackwell_moe.kernels import GroupedFp8Gemm

GROUP = 128                 # activation group and weight block width along K (DeepGEMM's only granularity)
FP8 = paddle.float8_e4m3fn


@dataclass(slots=True)
class Fp8Experts:
    """One layer's experts as the kernels take them: e4m3 ``[E, N, K]`` and SM100 int32 scales."""

    w13: Any           # [E, 2I, H]: gate rows, then up rows
    w13_scales: Any    # [E, ceil(ceil(H/128)/4), align(2I, 4)] int32 (packed UE8M0, MN-major)
    w2: Any            # [E, H, I]
    w2_scales: Any     # [E, ceil(ceil(I/128)/4), align(H, 4)] int32
    hidden: int
    inter: int

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])


def ue8m0_rows(q: Any, scale_rows: Any, block: tuple[int, int]) -> tuple[Any, Any]:
    """An ``fp8_block`` tensor ``q [E, N, K]`` with per-row scales (`ExpertWeights`) -> the same
    weights with power-of-two scales, per row. Scales already UE8M0 (``scale_fmt: ue8m0``) pass
    through; float ones are re-quantized tile by tile as vLLM's ``requant_weight_ue8m0_inplace``:
    the tile grid is every ``block[0]``-th row of the per-row scales (the loader repeated each
    tile's scale over its rows)."""
    if bool((ceil_to_ue8m0(scale_rows) == scale_rows).all()):
        return q, scale_rows
    bn = block[0]
    rows = int(q.shape[1])
    q, grid = requant_ue8m0(q, scale_rows[:, ::bn, :], block)
    return q, paddle.repeat_interleave(grid, bn, axis=1)[:, :rows, :]


def _rows_concat(a: Any, b: Any) -> Any:
    """``[E, N1, K]`` and ``[E, N2, K]`` e4m3 -> ``[E, N1 + N2, K]`` (on bytes: no fp8 concat kernel)."""
    return paddle.concat([a.view(paddle.uint8), b.view(paddle.uint8)], axis=1).view(FP8)


def pack_experts(weights: ExpertWeights) -> Fp8Experts:
    """`ExpertWeights` in ``fp8_block`` -> `Fp8Experts`; other formats and K blocks are refused."""
    if weights.format != "fp8_block" or weights.block[1] != GROUP:
        raise ConfigError(f"blackwell_fp8 runs fp8_block experts with {GROUP}-wide K blocks, not "
                          f"{weights.format!r} with block {list(weights.block)}.",
                          fix="serve an FP8 block checkpoint with weight_block_size [128, 128] (or --quantization "
                              "fp8), or select another MoE backend.")
    gate, gate_s = ue8m0_rows(weights.gate, weights.scales["gate"], weights.block)
    up, up_s = ue8m0_rows(weights.up, weights.scales["up"], weights.block)
    down, down_s = ue8m0_rows(weights.down, weights.scales["down"], weights.block)
    inter, hidden = int(gate.shape[1]), int(gate.shape[2])
    per_row = (1, GROUP)     # DeepGEMM broadcasts weight scales to one per output row on SM100
    return Fp8Experts(w13=_rows_concat(gate, up),
                      w13_scales=sm100_weight_scales(paddle.concat([gate_s, up_s], axis=1), 2 * inter, per_row),
                      w2=down, w2_scales=sm100_weight_scales(down_s, hidden, per_row), hidden=hidden, inter=inter)


def quant_rows(x: Any) -> tuple[Any, Any]:
    """Activations ``[..., M, K]`` -> (e4m3, SM100 int32 scales ``[..., ceil(ceil(K/128)/4), align(M, 4)]``)."""
    q, scales = per_token_group_quant(x, GROUP, ue8m0=True)
    return q, sm100_weight_scales(scales, int(x.shape[-2]), (1, GROUP))


def dispatch_quantized(hidden: Any, plan: Any, shape: list[int]) -> tuple[Any, Any]:
    """The tokens quantized once (``T`` rows, not the layout's ``M``), then laid out by ``plan`` as
    ``shape + [H]`` with their scales in the SM100 layout. Padding rows hold zeros with scale 1."""
    q, scales = per_token_group_quant(hidden, GROUP, ue8m0=True)
    rows = gather_rows(q.view(paddle.uint8), plan).view(FP8).reshape(shape + [int(hidden.shape[1])])
    row_scales = gather_rows(scales, plan)
    row_scales = (row_scales + (row_scales == 0).astype("float32")).reshape(shape + [int(scales.shape[1])])
    return rows, sm100_weight_scales(row_scales, shape[-1], (1, GROUP))


def swiglu_quant(gate_up: Any) -> tuple[Any, Any]:
    """``[..., M, 2I]`` (gate columns, then up) -> ``silu(gate) * up`` quantized as the next GEMM's input.
    One place for the step a fused kernel (SwiGLU + 1x128 UE8M0 quant) replaces."""
    inter = int(gate_up.shape[-1]) // 2
    h = F.silu(gate_up[..., :inter].astype("float32")) * gate_up[..., inter:].astype("float32")
    return quant_rows(h)


class BlackwellFp8MoE:
    """The MoE backend; ``gemm`` runs the grouped GEMMs, ``dispatch_tokens`` bounds the masked layout."""

    name = "blackwell_fp8"

    def __init__(self, gemm: GroupedFp8Gemm, dispatch_tokens: int) -> None:
        self.gemm = gemm
        self.dispatch_tokens = dispatch_tokens

    def load_weights(self, weights: ExpertWeights) -> Fp8Experts:
        return pack_experts(weights)

    def forward(self, hidden: Any, topk_weights: Any, topk_ids: Any, layer: Fp8Experts) -> Any:
        tokens = int(hidden.shape[0])
        if tokens == 0:
            return paddle.zeros([0, layer.hidden], dtype=hidden.dtype)
        if tokens <= self.dispatch_tokens:
            return self._masked(hidden, topk_weights, topk_ids, layer)
        return self._contiguous(hidden, topk_weights, topk_ids, layer)

    def _contiguous(self, hidden: Any, topk_weights: Any, topk_ids: Any, layer: Fp8Experts) -> Any:
        plan = plan_contiguous(topk_ids, layer.num_experts)
        x = dispatch_quantized(hidden, plan, [plan.num_rows])      # zero rows pad each expert to 128
        gate_up = paddle.empty([plan.num_rows, 2 * layer.inter], dtype="bfloat16")
        self.gemm.contiguous(x, (layer.w13, layer.w13_scales), gate_up, plan.m_indices)
        out = paddle.empty([plan.num_rows, layer.hidden], dtype="bfloat16")
        self.gemm.contiguous(swiglu_quant(gate_up), (layer.w2, layer.w2_scales), out, plan.m_indices)
        return combine(out, plan, topk_weights).astype(hidden.dtype)

    def _masked(self, hidden: Any, topk_weights: Any, topk_ids: Any, layer: Fp8Experts) -> Any:
        experts, capacity = layer.num_experts, self.dispatch_tokens
        plan = plan_masked(topk_ids, experts, capacity)
        x = dispatch_quantized(hidden, plan, [experts, capacity])
        expected = -(-int(topk_ids.size) // experts)         # rows per expert if the load were even
        gate_up = paddle.empty([experts, capacity, 2 * layer.inter], dtype="bfloat16")
        self.gemm.masked(x, (layer.w13, layer.w13_scales), gate_up, plan.masked_m, expected)
        out = paddle.empty([experts, capacity, layer.hidden], dtype="bfloat16")
        self.gemm.masked(swiglu_quant(gate_up), (layer.w2, layer.w2_scales), out, plan.masked_m, expected)
        return combine(out.reshape([experts * capacity, layer.hidden]), plan, topk_weights).astype(hidden.dtype)
