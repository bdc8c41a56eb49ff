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
why it did not; nothing here pretends a kernel exists. The sources are Paddle builds of DeepGEMM
(tensors are Paddle's, no copies through another framework).
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


@dataclass(frozen=True, slots=True)
class KernelSource:
    """A module that may provide the two grouped GEMMs, under these function names."""

    module: str
    contiguous: str
    masked: str
    install: str


SOURCES = (
    KernelSource("deep_gemm", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked",
                 "a Paddle build of DeepGEMM >= 2.0 (SM100 kernels) importable as `deep_gemm`"),
    KernelSource("paddlefleet_ops.deep_gemm", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked",
                 "PaddleFleet's DeepGEMM ops (`paddlefleet_ops`)"),
)
NEEDED = "DeepGEMM's grouped FP8 GEMMs m_grouped_fp8_gemm_nt_contiguous and m_grouped_fp8_gemm_nt_masked"


@dataclass(frozen=True, slots=True)
class DeepGemm:
    """`GroupedFp8Gemm` over one imported source; scales are passed as prepared (no UE8M0 cast)."""

    name: str
    _contiguous: Any
    _masked: Any

    def contiguous(self, a: tuple[Any, Any], b: tuple[Any, Any], out: Any, m_indices: Any) -> None:
        self._contiguous(a, b, out, m_indices, disable_ue8m0_cast=True)

    def masked(self, a: tuple[Any, Any], b: tuple[Any, Any], out: Any, masked_m: Any, expected_m: int) -> None:
        self._masked(a, b, out, masked_m, expected_m, disable_ue8m0_cast=True)


def _load(source: KernelSource) -> tuple[DeepGemm | None, str]:
    try:
        module = importlib.import_module(source.module)
    except Exception as exc:      # ImportError, or a binary built for another CUDA/paddle
        return None, f"{source.module}: not importable ({type(exc).__name__}: {exc})"
    missing = [fn for fn in (source.contiguous, source.masked) if not callable(getattr(module, fn, None))]
    if missing:
        return None, f"{source.module}: has no {', '.join(missing)}"
    return DeepGemm(source.module, getattr(module, source.contiguous), getattr(module, source.masked)), ""


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
