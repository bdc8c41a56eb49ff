"""``cpu_native`` MoE: the routed experts of a layer in one compiled call, every core busy.

The reference backend loops over experts in Python: a dozen Paddle ops per expert per layer, so a
decode step of a 32-expert model spends most of its time dispatching. Here `moe_experts`
groups the assignments by expert once and runs each expert's gate/up and down GEMMs (SwiGLU fused)
as work items spread over the threads, then sums each token's top-k outputs in k order. The weights
are repacked once at load time (`pack_experts`).

FP8 block experts (``fp8_block``) stay one byte a weight: a layer is one compiled call that runs
both grouped FP8 GEMMs over the experts that got tokens (`Fp8Experts`), no dequantized copy of any.

A GGUF file's experts (``gguf``) stay in their GGML blocks too (`GgufExperts`): each expert that got
tokens runs its gate, up and down through the cpu ``gguf_linear`` kernel, which reads the blocks in
place (`native_gguf`), in the reference backend's loop over experts (one Python step per expert, not
one compiled call a layer: a later speedup).

Routing is the core's (`fdplug.core.portable.moe_routing.select_experts`); this backend only gets the chosen
ids and weights, so it cannot route differently from any other backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fdplug.core.portable.moe import ReferenceMoE
from fdplug.errors import ConfigError
from fdplug.plugin_api.moe import ExpertWeights
from fdplug.plugins.cpu import kernels, native_fp8, native_gguf


class NativeCpuMoE:
    name = "cpu_native"

    def __init__(self, threads: int) -> None:
        kernels.load()  # fail at construction, not at the first step
        self.threads = threads

    def load_weights(self, weights: ExpertWeights) -> Any:
        if weights.format == "fp8_block":
            return Fp8Experts.from_weights(weights)
        if weights.format == "gguf":
            return GgufExperts.from_weights(weights, self.threads)
        if weights.format != "none":
            raise ConfigError(f"the cpu_native MoE backend runs float, fp8_block and gguf experts, not "
                              f"{weights.format!r}.",
                              fix="select a MoE backend that executes this format (`fdplug explain --moe ...`).")
        return pack_experts(weights.gate, weights.up, weights.down)

    def forward(self, hidden: Any, topk_weights: Any, topk_ids: Any, layer: Any) -> Any:
        if isinstance(layer, Fp8Experts):
            return layer.forward(hidden, topk_weights, topk_ids, self.threads)
        if isinstance(layer, GgufExperts):     # the reference's loop over experts, each run by `GgufExperts.run`
            return _LOOP.forward(hidden, topk_weights, topk_ids, layer)
        ids = np.ascontiguousarray(topk_ids.numpy(), dtype=np.int32)
        weights = np.ascontiguousarray(topk_weights.numpy(), dtype=np.float32)
        return moe_experts(hidden, layer, ids, weights, self.threads)


@dataclass(slots=True)
class Fp8Experts:
    """A layer's FP8 experts kept one byte a weight: ``w13 [E, 2I, H]`` (gate rows, then up) and
    ``w2 [E, H, I]`` e4m3 with their per-row block scales, read in place by one compiled call a
    layer (`native_fp8.fp8_moe`)."""

    w13: Any
    s13: Any
    w2: Any
    s2: Any
    block_k: int

    @classmethod
    def from_weights(cls, weights: ExpertWeights) -> Fp8Experts:
        import paddle

        w13 = paddle.concat([weights.gate.view(paddle.uint8), weights.up.view(paddle.uint8)], axis=1)
        s13 = paddle.concat([weights.scales["gate"], weights.scales["up"]], axis=1)
        return cls(w13.view(paddle.float8_e4m3fn), s13, weights.down, weights.scales["down"], weights.block[1])

    def forward(self, hidden: Any, topk_weights: Any, topk_ids: Any, threads: int) -> Any:
        return native_fp8.fp8_moe(hidden, self, topk_ids.numpy(), topk_weights.numpy(), threads)


@dataclass(slots=True)
class GgufExperts:
    """A layer's experts as a GGUF file stores them: uint8 ``[E, rows, row_bytes]`` of the GGML types
    ``qtypes`` (`ExpertWeights`), read in place by `native_gguf.gguf_linear_or_portable` (a type the
    kernel lacks, such as F32, runs the portable op: the same numbers)."""

    gate: Any
    up: Any
    down: Any
    qtypes: dict[str, str]
    threads: int

    @classmethod
    def from_weights(cls, weights: ExpertWeights, threads: int) -> GgufExperts:
        weights.check_gguf()
        return cls(weights.gate, weights.up, weights.down, dict(weights.qtypes), threads)

    def run(self, e: int, x: Any) -> Any:
        """Expert ``e`` on rows ``x [n, H]`` float32: ``down(silu(gate(x)) * up(x))``, each a view of
        its ``[rows, row_bytes]`` blocks handed to the kernel (no copy)."""
        import paddle.nn.functional as F

        hidden, inter = int(self.down.shape[1]), int(self.gate.shape[1])
        gate, up = (native_gguf.gguf_linear_or_portable(x, w[e], self.qtypes[name], hidden, self.threads)
                    for name, w in (("gate", self.gate), ("up", self.up)))
        return native_gguf.gguf_linear_or_portable(F.silu(gate) * up, self.down[e], self.qtypes["down"], inter,
                                                   self.threads)


_LOOP = ReferenceMoE()


@dataclass(frozen=True, slots=True)
class PackedExperts:
    """One layer's routed experts in the layout ``fdplug_moe_experts`` reads (see the C file).

    ``gate_up`` [E, 2*I*H]: per expert, panels of 8 intermediate columns, each ``[H][8 gate | 8 up]``
    (the last panel narrower when I is not a multiple of 8). ``down`` [E, H*I]: per expert, panels
    of 16 output columns, each ``[I][16]`` (the last one narrower). Exactly the inputs' floats.
    """

    gate_up: Any
    down: Any
    num_experts: int
    hidden: int
    inter: int


def pack_experts(gate: Any, up: Any, down: Any, threads: int = 1) -> PackedExperts:
    """One layer's experts (``gate``, ``up`` [E, I, H], ``down`` [E, H, I], float32) repacked, at load time.

    The result holds new tensors only (as many bytes as the inputs, which it does not keep).
    """

    lib = kernels.load()
    gate, up, down = kernels._contiguous(gate), kernels._contiguous(up), kernels._contiguous(down)
    kernels._check_float32(gate, up, down)
    if len(gate.shape) != 3 or list(up.shape) != list(gate.shape):
        raise ValueError(f"gate and up must both be [E, I, H], got {list(gate.shape)} and {list(up.shape)}")
    experts, inter, hidden = (int(n) for n in gate.shape)
    if list(down.shape) != [experts, hidden, inter]:
        raise ValueError(f"down must be [E, H, I] = {[experts, hidden, inter]}, got {list(down.shape)}")
    if min(experts, inter, hidden) <= 0 or 2 * inter * hidden >= 2**31:
        raise ValueError(f"unsupported expert shape E={experts} I={inter} H={hidden}")
    gate_up = kernels.empty_f32([experts, 2 * inter * hidden])
    packed_down = kernels.empty_f32([experts, hidden * inter])
    lib.fdplug_moe_pack(gate.data_ptr(), up.data_ptr(), down.data_ptr(), gate_up.data_ptr(), packed_down.data_ptr(),
                        experts, hidden, inter, max(1, threads))
    return PackedExperts(gate_up, packed_down, experts, hidden, inter)


def moe_experts(x: Any, packed: PackedExperts, topk_ids: np.ndarray, topk_weights: np.ndarray,
                threads: int) -> Any:
    """``out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t)``, ``e = topk_ids[t, k]``.

    ``x`` [T, H] float32; ``topk_ids`` int32 and ``topk_weights`` [T, K]. Each token's row is the
    same, bit for bit, whatever else is in the batch and however many threads run it. An id outside
    ``[0, E)`` is a ValueError (checked in C before anything is read through it).
    """

    x = kernels._contiguous(x)
    kernels._check_float32(x)
    if len(x.shape) != 2 or int(x.shape[1]) != packed.hidden:
        raise ValueError(f"x must be [T, {packed.hidden}], got {x.shape}")
    ids = np.asarray(topk_ids)
    if ids.dtype != np.int32:
        raise TypeError(f"topk_ids must be int32, got {ids.dtype}")
    ids = np.ascontiguousarray(ids)
    weights = np.ascontiguousarray(topk_weights, dtype=np.float32)
    tokens = int(x.shape[0])
    if ids.ndim != 2 or ids.shape[0] != tokens or weights.shape != ids.shape or ids.shape[1] < 1:
        raise ValueError(f"topk_ids and topk_weights must both be [{tokens}, K], got {ids.shape} and {weights.shape}")
    out = kernels.empty_f32([tokens, packed.hidden])
    if tokens == 0:
        return out
    status = kernels.load().fdplug_moe_experts(
        x.data_ptr(), packed.gate_up.data_ptr(), packed.down.data_ptr(), ids.ctypes.data, weights.ctypes.data,
        out.data_ptr(), tokens, ids.shape[1], packed.num_experts, packed.hidden, packed.inter, threads)
    if status == -2:
        bad = ids[(ids < 0) | (ids >= packed.num_experts)]
        raise ValueError(f"expert id {int(bad[0])} is outside [0, {packed.num_experts})")
    if status != 0:
        raise MemoryError("the cpu MoE kernel could not allocate its scratch memory")
    return out
