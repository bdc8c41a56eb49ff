"""The float linear layer, and what every linear layer shares: weights without storage, prepared once.

Linear weights are kept as checkpoints store them, ``[out, in]``, and created without storage: the
loader assigns every one of them, so time spent on an init (even zero-filling) would be waste. A
kernel may lay a weight out its own way once at load (`PreparedWeightMixin`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import paddle
from paddle import nn

from fdplug.core.portable.ops import PORTABLE
from fdplug.plugin_api.ops import PreparedWeight


def empty_parameter(shape: list[int], dtype: str) -> Any:
    """A parameter with no storage yet: the loader assigns every one (and checks that it does)."""
    from paddle.base.framework import EagerParamBase

    p = EagerParamBase(shape=shape, dtype=dtype)
    p.stop_gradient = True  # inference only: no autograd bookkeeping per op
    return p


class PreparedWeightMixin:
    """`prepare` for a layer whose ``weight`` a kernel may lay out its own way once at load
    (`OpSpec.prepare`): the prepared values replace the checkpoint's as the layer's parameter (one
    copy, the same dtype and element count, so footprints add up) and carry the layer's bias, which
    the kernel then adds; ``kernel_weight`` is what the layer hands its kernel."""

    weight: Any
    prepared: PreparedWeight | None = None   # until `prepare` (a class default: no per-layer init)

    def prepare(self, prepare: Callable[[Any], PreparedWeight | None]) -> None:
        if self.prepared is not None:
            return
        prepared = prepare(self.weight)
        if prepared is None:
            return
        shape, data = tuple(self.weight.shape), prepared.data
        if (tuple(prepared.shape) != shape or data.dtype != self.weight.dtype
                or int(np.prod(data.shape)) != shape[0] * shape[1]):
            raise ValueError(f"the kernel prepared a {list(shape)} {self.weight.dtype} weight as "
                             f"{list(data.shape)} {data.dtype} (logical {list(prepared.shape)}): it must keep "
                             "the dtype, the element count and the logical shape")
        param = empty_parameter(list(data.shape), data.dtype)
        paddle.assign(data, param)
        self.weight = param
        self.prepared = PreparedWeight(param, shape, prepared.layout, getattr(self, "bias", None))

    def add_bias(self, out: Any) -> Any:
        """The bias, where the kernel did not add it (a weight it did not prepare)."""
        bias = getattr(self, "bias", None)
        return out if bias is None or self.prepared is not None else out + bias

    @property
    def kernel_weight(self) -> Any:
        return self.weight if self.prepared is None else self.prepared


class Linear(PreparedWeightMixin, nn.Layer):
    """``x @ weight^T (+ bias)`` with ``weight [out, in]`` as the checkpoint stores it, through the
    selected ``linear`` op (`fdplug.plugin_api.ops`); fused projections are one of these.

    ``weight_dtype`` is the compute dtype, or bfloat16 on a device computing in float32
    (`ModelConfig.bf16_weights`): half the bytes, float32 math on the same values. The bias stays in
    the compute dtype. After load, `prepare` may hand the weight to the kernel's own layout.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: str, kernel: Any = None,
                 weight_dtype: str | None = None) -> None:
        super().__init__()
        self.kernel = kernel or PORTABLE.linear
        self.weight = empty_parameter([out_features, in_features], weight_dtype or dtype)
        self.bias = empty_parameter([out_features], dtype) if bias else None

    def forward(self, x: Any) -> Any:
        return self.add_bias(self.kernel(x, self.kernel_weight))
