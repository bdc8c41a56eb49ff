"""Layers whose weights stay in a GGUF file's GGML blocks: the linear, and the embedding table's rows.

A `GgufLinear` keeps each row group of one block type (`gguf_weights.GgufLayout`) as the file's
bytes, ``uint8 [rows, row_bytes]``, and runs the selected ``gguf_linear`` op on each
(`fdplug.plugin_api.ops`): the portable op dequantizes the group for the call, a device kernel reads
the blocks in place. A projection fused from tensors of different types (a Q4_K_M file's q/k in
Q4_K and v in Q6_K) runs one op per group and joins the columns: the same numbers as one matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import paddle
from paddle import nn

from fdplug.core.model.checkpoint.gguf_weights import GgufLayout
from fdplug.core.model.layers.linear import empty_parameter
from fdplug.core.portable.ops import PORTABLE
from fdplug.core.quant.gguf_blocks import dequantize, row_bytes
from fdplug.errors import WeightMismatchError
from fdplug.plugin_api.ops import PreparedWeight


class GgufLinear(nn.Layer):
    """``x @ W^T (+ bias)`` with ``W``'s row groups kept as GGML blocks: ``weight`` (the first group),
    ``weight_1``, ``weight_2``... in row order; the bias in the compute dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str, layout: GgufLayout,
                 kernel: Callable[[Any, Any, str, int], Any]) -> None:

        super().__init__()
        if layout.rows != out_features:
            raise WeightMismatchError(f"the GGUF tensors of {', '.join(layout.modules)} have {layout.rows} rows, but "
                                      f"the file's metadata makes them {out_features}.", tensor=layout.modules[0],
                                      fix="the file does not match its own metadata: download it again, or convert "
                                          "it again with llama.cpp.")
        self.in_features, self.layout = in_features, layout
        # the op's kernel per group: the selected one, or the portable op where it measured faster on
        # the group's shape (`use_portable`, `fdplug.core.worker.op_timing`)
        self.kernels: tuple[Callable, ...] = (kernel,) * len(layout.groups)
        self.names = tuple("weight" if i == 0 else f"weight_{i}" for i in range(len(layout.groups)))
        for name, (qtype, rows) in zip(self.names, layout.groups, strict=True):
            setattr(self, name, empty_parameter([rows, row_bytes(qtype, in_features)], "uint8"))
        self.bias = empty_parameter([out_features], dtype) if bias else None
        # what forward hands the kernel, per group: these parameters (the loader fills them in place),
        # or what the kernel's prepare made of them; resolved once here, not on every call
        self.kernel_weights: tuple[Any, ...] = tuple(getattr(self, name) for name in self.names)
        self.prepared = False

    def group_of(self, row: int) -> tuple[str, int]:
        """The parameter holding output row ``row``, and the row's index in it."""
        for name, (_, rows) in zip(self.names, self.layout.groups, strict=True):
            if row < rows:
                return name, row
            row -= rows
        raise IndexError(f"row {row} beyond the layer's {self.layout.rows}")

    def use_portable(self, group: int) -> None:
        """Run group ``group`` through the portable op (its shape measured faster there); before
        `prepare`, which then leaves that group's bytes as they are."""
        self.kernels = tuple(PORTABLE.gguf_linear if i == group else k for i, k in enumerate(self.kernels))

    def prepare(self, prepare: Callable[[Any, str], PreparedWeight | None]) -> None:
        """Hand each group its kernel runs to that kernel's ``prepare`` once (`OpSpec.prepare`); it
        keeps the bytes. A group on the portable op reads them as they are."""
        if self.prepared:
            return
        prepared = []
        for name, (qtype, _), kernel in zip(self.names, self.layout.groups, self.kernels, strict=True):
            weight = getattr(self, name)
            each = None if kernel is PORTABLE.gguf_linear else prepare(weight, qtype)
            if each is not None and (each.data.dtype != weight.dtype or each.data.size != weight.size):
                raise ValueError(f"the kernel prepared a {qtype} weight of {weight.size} bytes as "
                                 f"{each.data.size} {each.data.dtype}: it must keep the bytes")
            prepared.append(weight if each is None else each)
        self.kernel_weights, self.prepared = tuple(prepared), True

    def forward(self, x: Any) -> Any:
        outs = [kernel(x, w, qtype, self.in_features)
                for kernel, w, (qtype, _) in zip(self.kernels, self.kernel_weights, self.layout.groups, strict=True)]
        out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=-1)
        return out if self.bias is None else out + self.bias


def embedding_rows(table: Any, qtype: str, hidden: int, input_ids: Any, dtype: str) -> Any:
    """Rows ``input_ids`` of an embedding table kept in GGML blocks, dequantized (only those rows)."""
    return dequantize(paddle.gather(table, input_ids), qtype, hidden, dtype)
