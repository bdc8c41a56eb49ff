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
    block scales, `fdplug.core.model.fp8_layers`) -> ``y [..., N] = x @ (weight * scale)^T`` (no bias).
    A kernel may keep the weights one byte each; it must not change them.
``bf16_linear(x, weight) -> y``
    ``x [..., K]``, ``weight [N, K]`` bfloat16 (the checkpoint's layout, as the FP8 weights) ->
    ``y [..., N] = x @ float32(weight)^T`` in ``x``'s dtype: bf16 storage, ``x``'s arithmetic. On a
    device that computes in float32 this halves the weight bytes a decode step reads; the widening
    is exact, so the result is the float32 model's with the same (bf16) weights.

A kernel must agree with the portable implementation to float32 rounding (relative 1e-5); the
conformance kit (`fdplug.testing`) checks every registered op against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

OPS: tuple[str, ...] = ("swiglu", "rms_norm", "fp8_linear", "bf16_linear")
"""Every op a plugin may override, in the order `Kernels` lists them."""


@dataclass(frozen=True, slots=True)
class Kernels:
    """The op implementations the model calls: one callable per name in `OPS`."""

    swiglu: Callable[[Any], Any]
    rms_norm: Callable[[Any, Any, float], Any]
    fp8_linear: Callable[[Any, Any, Any, int], Any]
    bf16_linear: Callable[[Any, Any], Any]
