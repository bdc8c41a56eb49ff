"""ERNIE-4.5-VL's MoE MLP: modality experts. Text tokens go through the text experts, an item's tokens
(its placeholders with the start and end tokens around them) through the vision experts, each set
with its own router and selection bias; every token also goes through the shared experts.

Each set is a `moe_block.SparseMoEBlock` run by the selected MoE backend, so every backend that
runs ERNIE-4.5-MoE runs these (the vision experts may be narrower: the backend gets their width
with their weights). Which rows are vision rows comes with the step (``modality_rows``, from the
runner: prompt tokens of an item and its start and end tokens); a decode token is text.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import paddle
from paddle import nn

from fdplug.core.model.checkpoint.moe_config import MoEConfig
from fdplug.core.model.layers.basic import SwiGLU
from fdplug.core.model.layers.linear import empty_parameter
from fdplug.core.model.layers.moe_block import SparseMoEBlock
from fdplug.plugin_api.ops import Kernels


class ModalityMoE(nn.Layer):
    def __init__(self, hidden: int, moe: MoEConfig, backend: Any, dtype: str, kernels: Kernels, bias: bool,
                 prefix: str = "", bf16: bool = False) -> None:
        super().__init__()
        own = replace(moe, shared_intermediate_size=0, vision=None)
        self.text = SparseMoEBlock(hidden, own, backend, dtype, kernels, None, prefix, bf16)
        self.vision = SparseMoEBlock(hidden, replace(moe.vision, shared_intermediate_size=0), backend, dtype,
                                     kernels, None, prefix, bf16)
        # the checkpoint holds both sets' selection biases as one [2, E] statistic (row 0: text)
        self.text.e_score_correction_bias = self.vision.e_score_correction_bias = None
        self.e_score_correction_bias = empty_parameter([2, moe.num_experts], "float32") if moe.routing.bias else None
        self.shared_expert = (SwiGLU(hidden, moe.shared_intermediate_size, bias, dtype, kernels, bf16=bf16)
                              if moe.shared_intermediate_size else None)

    def forward(self, x: Any, modality_rows: tuple[Any, Any] | None = None) -> Any:
        """``x [T, hidden]``; ``modality_rows``: the int64 row indices of the text and of the vision
        tokens (`ModalityRows`; None: every row is text)."""
        text_bias, vision_bias = ((None, None) if self.e_score_correction_bias is None else
                                  (self.e_score_correction_bias[0:1], self.e_score_correction_bias[1:2]))
        if modality_rows is None:
            out = self.text(x, text_bias)
        else:
            out = paddle.zeros_like(x)
            for rows, block, bias in zip(modality_rows, (self.text, self.vision), (text_bias, vision_bias)):
                if rows is not None:
                    out = paddle.scatter(out, rows, block(paddle.gather(x, rows), bias))
        return out if self.shared_expert is None else out + self.shared_expert(x)
