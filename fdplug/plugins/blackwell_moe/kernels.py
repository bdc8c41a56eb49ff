"""The grouped FP8 GEMMs `backend.BlackwellFp8MoE` calls, and where they come from.

Both are DeepGEMM's (deepseek-ai/DeepGEMM), ``D = A @ B^T`` per expert with e4m3 inputs, 1x128
activation scales, per-row weight scales and a bf16 output:

- ``contiguous(a, b, out, m_indices)``: ``a = (x [M, K], sfa)``, ``b = (w [E, N, K], sfb)``,
  ``out [M, N]``; row ``m`` uses expert ``m_indices[m]`` (-1: padding, skipped);
- ``masked(a, b, out, masked_m, expected_m)``: ``a = (x [E, C, K], sfa)``, ``out [E, C, N]``;
  expert ``e`` computes its first ``masked_m[e]`` rows; ``expected_m`` is a tile-size hint.

Scales arrive already in the SM100 layout (`fdplug.plugin_api.fp8.sm100_weight_scales`: packed
UE8M0, MN-major, int32), so the kernel does no conversion of its own.

`find_kernels` imports the first source that provides both functions and says, for every source,
why it did not; nothing here pretends a kernel exists. Signatures as vLLM calls them
(``vllm/utils/deep_gemm.py``): ``(a, b, d, m_indices)`` and ``(a, b, d, masked_m, expected_m)``.
DeepGEMM itself is a PyTorch extension: its tensors reach it through DLPack without a copy (e4m3
as a uint8 view, viewed back as ``torch.float8_e4m3fn``), on paddle's current CUDA stream
(``torch.cuda.ExternalStream``), so no synchronisation is added. A Paddle build (PaddleFleet's
ops) takes paddle tensors directly.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol


class GroupedFp8Gemm(Protocol):
    """What the backend needs from a kernel library."""

    name: str

    def contiguous(self, a: tuple[Any, Any], b: tuple[Any, Any], out: Any, m_indices: Any) -> None: ...

    def masked(self, a: tuple[Any, Any], b: tuple[Any, Any], out: Any, masked_m: Any, expected_m: int) -> None: ...

    def dense(self, a: tuple[Any, Any], b: tuple[Any, Any], out: Any) -> None:
        """``out [M, N] = a [M, K] @ b [N, K]^T`` (DeepGEMM ``fp8_gemm_nt``), for the dense FP8 linears."""
        ...


@dataclass(frozen=True, slots=True)
class KernelSource:
    """A module that may provide the two grouped GEMMs, under these function names; ``framework``
    is whose tensors it takes (``torch``: passed through DLPack)."""

    module: str
    contiguous: str
    masked: str
    install: str
    framework: str = "paddle"
    dense: str = "fp8_gemm_nt"


SOURCES = (
    KernelSource("paddlefleet_ops.deep_gemm", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked",
                 "PaddleFleet's DeepGEMM ops (`paddlefleet_ops`)"),
    KernelSource("deep_gemm", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked",
                 "DeepGEMM >= 2.0 with its SM100 kernels (github.com/deepseek-ai/DeepGEMM, a PyTorch extension: "
                 "torch with CUDA in the same environment)", framework="torch"),
)
NEEDED = "DeepGEMM's grouped FP8 GEMMs m_grouped_fp8_gemm_nt_contiguous and m_grouped_fp8_gemm_nt_masked"


@dataclass(frozen=True, slots=True)
class DeepGemm:
    """`GroupedFp8Gemm` over one imported source. The scales are already packed UE8M0 (int32), which
    DeepGEMM checks and uses as given; ``framework == "torch"`` bridges every tensor through DLPack."""

    name: str
    _contiguous: Any
    _masked: Any
    framework: str = "paddle"
    _dense: Any = None       # fp8_gemm_nt, where the source has it

    @property
    def has_dense(self) -> bool:
        return self._dense is not None

    def dense(self, a: tuple[Any, Any], b: tuple[Any, Any], out: Any) -> None:
        with self._stream():
            self._dense(self._pair(a), self._pair(b), self._t(out))

    def contiguous(self, a: tuple[Any, Any], b: tuple[Any, Any], out: Any, m_indices: Any) -> None:
        with self._stream():
            self._contiguous(self._pair(a), self._pair(b), self._t(out), self._t(m_indices))

    def masked(self, a: tuple[Any, Any], b: tuple[Any, Any], out: Any, masked_m: Any, expected_m: int) -> None:
        with self._stream():
            self._masked(self._pair(a), self._pair(b), self._t(out), self._t(masked_m), expected_m)

    def _pair(self, pair: tuple[Any, Any]) -> tuple[Any, Any]:
        return self._t(pair[0]), self._t(pair[1])

    def _t(self, tensor: Any) -> Any:
        """A paddle tensor as the source's framework sees it (the same memory)."""
        if self.framework == "paddle":
            return tensor
        import paddle
        import torch

        fp8 = tensor.dtype == paddle.float8_e4m3fn
        shared = torch.utils.dlpack.from_dlpack(paddle.utils.dlpack.to_dlpack(tensor.view(paddle.uint8) if fp8
                                                                               else tensor))
        return shared.view(torch.float8_e4m3fn) if fp8 else shared

    def _stream(self) -> Any:
        """Torch kernels on paddle's current CUDA stream, so they order with paddle's own work."""
        import contextlib

        if self.framework == "paddle":
            return contextlib.nullcontext()
        import paddle
        import torch

        return torch.cuda.stream(torch.cuda.ExternalStream(paddle.device.cuda.current_stream().cuda_stream))


def _load(source: KernelSource) -> tuple[DeepGemm | None, str]:
    try:
        module = importlib.import_module(source.module)
    except Exception as exc:      # ImportError, or a binary built for another CUDA/paddle
        return None, f"{source.module}: not importable ({type(exc).__name__}: {exc})"
    missing = [fn for fn in (source.contiguous, source.masked) if not callable(getattr(module, fn, None))]
    if missing:
        return None, f"{source.module}: has no {', '.join(missing)}"
    dense = getattr(module, source.dense, None)
    return DeepGemm(source.module, getattr(module, source.contiguous), getattr(module, source.masked),
                    source.framework, dense if callable(dense) else None), ""


def find_kernels(sources: tuple[KernelSource, ...] = SOURCES) -> tuple[DeepGemm | None, list[str]]:
    """The first source providing both GEMMs, and why each one before it (or every one) did not."""
    reasons = []
    for source in sources:
        kernels, reason = _load(source)
        if kernels is not None:
            return kernels, reasons
        reasons.append(reason)
    return None, reasons


def missing_kernels_reason(reasons: list[str], sources: tuple[KernelSource, ...] = SOURCES) -> str:
    """The refusal when no source loads: what is needed, what was tried, what to install."""
    return (f"needs {NEEDED}; tried {'; '.join(reasons)}. Install one of: "
            + "; ".join(s.install for s in sources))
