"""The portable FP8 path: weights stay e4m3 in memory, each use dequantizes them to the compute dtype.

A checkpoint stores one float32 scale per ``bn x bk`` tile. Fused projections (q/k/v, gate/up, the
experts of a layer) join tensors whose tile grids need not line up (a k projection of 2 heads of
64 rows is half a 128-row tile), so the loader keeps the scales *per row*: ``[N, ceil(K / bk)]``,
each tile's scale repeated over its rows (`expand_scale_rows`). That costs ``4 / bk`` bytes per
weight (3% of the e4m3 bytes at bk = 128) and makes any row range, fusion or RoPE row permutation
of the weight a plain row operation on its scales too. It is also the layout Blackwell's kernels
read (one scale row per output row).

Every device runs this path (plain Paddle ops); it is the numerics reference for FP8 kernels and a
ceiling for them to beat, not a fast path: a layer's float weights exist only while it runs.
"""

from __future__ import annotations

from typing import Any

from paddle import nn

from fdplug.core.model.checkpoint.quant_config import QuantConfig
from fdplug.core.model.layers.linear import PreparedWeightMixin, empty_parameter
from fdplug.core.portable.ops import PORTABLE
from fdplug.core.quant.fp8_rows import FP8_DTYPE


class Fp8Linear(PreparedWeightMixin, nn.Layer):
    """``x @ W^T (+ bias)`` with ``W`` kept as ``weight [out, in]`` e4m3 and ``weight_scale [out, ceil(in / bk)]``.

    HF layout (``[out, in]``, not transposed like `layers.Linear`): paddle cannot transpose-copy
    fp8 on every device, and ``matmul(transpose_y=True)`` reads it as stored.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str, quant: QuantConfig,
                 kernel: Any = None) -> None:
        """``kernel``: the selected ``fp8_linear`` op (`fdplug.plugin_api.ops`; default: the portable one)."""

        super().__init__()
        self.dtype_name, self.block_k = dtype, quant.block[1]
        self.kernel = kernel or PORTABLE.fp8_linear
        self.weight = empty_parameter([out_features, in_features], FP8_DTYPE)
        self.weight_scale = empty_parameter([out_features, -(-in_features // self.block_k)], "float32")
        self.bias = empty_parameter([out_features], dtype) if bias else None

    def forward(self, x: Any) -> Any:
        return self.add_bias(self.kernel(x, self.kernel_weight, self.weight_scale, self.block_k))
