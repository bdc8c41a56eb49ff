"""``blackwell_fp8_linear``: the ``fp8_linear`` op on Blackwell, one DeepGEMM ``fp8_gemm_nt`` a call.

The activations are quantized per 1x128 group with UE8M0 scales (`backend.quant_rows`), the weight
is used as stored (e4m3 ``[N, K]``) with its scales packed once into DeepGEMM's SM100 layout, and
the bf16 product is cast back to the compute dtype. Packing happens the first time a weight is
seen and is kept for the life of the engine (one entry per FP8 layer): float-scale checkpoints are
re-quantized to UE8M0 as vLLM does (`backend.ue8m0_rows`), which costs a one-byte-a-weight copy;
``scale_fmt: ue8m0`` checkpoints need none.

Selected only with ``FD_USE_BLACKWELL_GEMM=1`` (FastDeploy's switch, off by default there too,
and it needs ``FD_USE_DEEP_GEMM=1``) on a GPU that `requirements.unmet` accepts.
"""

from __future__ import annotations

from typing import Any

import paddle

from fdplug.plugin_api.fp8 import sm100_weight_scales
from fdplug.plugins.blackwell_moe.backend import GROUP, quant_rows, ue8m0_rows


class BlackwellFp8Linear:
    """The op: ``(x, weight, weight_scale, block_k) -> x @ (weight * scale)^T`` in ``x``'s dtype."""

    def __init__(self, gemm: Any) -> None:
        self.gemm = gemm
        self._packed: dict[int, tuple[Any, Any, Any]] = {}   # id(weight) -> (weight, e4m3, SM100 scales)

    def _pack(self, weight: Any, weight_scale: Any) -> tuple[Any, Any]:
        entry = self._packed.get(id(weight))
        if entry is None or entry[0] is not weight:
            q, scales = ue8m0_rows(weight.unsqueeze(0), weight_scale.unsqueeze(0), (GROUP, GROUP))
            entry = (weight, q[0], sm100_weight_scales(scales[0], int(weight.shape[0]), (1, GROUP)))
            self._packed[id(weight)] = entry     # the weight itself is kept: its id cannot be reused
        return entry[1], entry[2]

    def __call__(self, x: Any, weight: Any, weight_scale: Any, block_k: int) -> Any:
        if block_k != GROUP:
            raise ValueError(f"blackwell_fp8_linear runs {GROUP}-wide K blocks, got {block_k} "
                             "(selection refuses such models; this is a wiring bug)")
        *lead, depth = x.shape
        cols, rows = int(weight.shape[0]), 1
        for d in lead:
            rows *= int(d)
        if rows == 0:
            return paddle.zeros([*lead, cols], dtype=x.dtype)
        b = self._pack(weight, weight_scale)
        out = paddle.empty([rows, cols], dtype="bfloat16")
        self.gemm.dense(quant_rows(x.reshape([rows, depth])), b, out)
        return out.astype(x.dtype).reshape([*lead, cols])
