"""The portable kernel of every op in `fdplug.plugin_api.ops` (its contracts are written there)."""

from __future__ import annotations

from typing import Any

import paddle
import paddle.nn.functional as F

from fdplug.plugin_api.ops import Kernels


def swiglu(x: Any) -> Any:
    return F.swiglu(x)


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    h = x if x.dtype == paddle.float32 else x.astype("float32")
    h = h * paddle.rsqrt((h * h).mean(axis=-1, keepdim=True) + eps)
    return weight * (h if h.dtype == x.dtype else h.astype(x.dtype))


PORTABLE = Kernels(swiglu=swiglu, rms_norm=rms_norm)
"""The table a model gets when nobody chose kernels for it (tests, tools)."""
