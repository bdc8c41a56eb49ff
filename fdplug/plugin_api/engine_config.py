"""What a plugin sees of the engine's configuration: `ModelTraits` and the read-only `EngineView`.

Every ``supports``, ``factory``, ``prepare`` and ``measure_key`` of a spec (`specs`) and the
``fdplug_configure`` hook receive the engine's configuration. The core's object
(``fdplug.core.config.EngineConfig``) has more in it, and is the core's to change; a plugin reads it
through the properties below and never writes it (``fdplug_configure`` refuses a configuration by
raising `fdplug.errors.ConfigError`). `tests/test_hookspecs.py` holds the core's class to this view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ModelTraits:
    """What a backend needs to know about a model to say whether it supports it.

    Built from the model's config when one is known; selection without a model (``fdplug explain``)
    passes ``EngineConfig.model = None`` and backends answer for the general case.
    """

    architecture: str = ""
    dtype: str = "float32"
    num_attention_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    hidden_size: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    moe_weight_format: str = "none"      # the routed experts' format, for the MoE backend
    linear_weight_format: str = "none"   # the other linear layers' format, for the model runner
    weight_block: tuple[int, int] = ()   # a quantized format's (rows, cols) block, e.g. (128, 128)
    weight_types: tuple[str, ...] = ()   # format "gguf": the GGML block types of its linears (Q4_K, Q6_K...)
    mask_policy: str = "causal"


class EngineView(Protocol):
    """The engine configuration as a plugin reads it (vLLM's names where the concept is the same).

    Fields the core derives (``None`` or ``auto`` as the user left them: sizes, ``dtype``) may still
    be unresolved when ``supports`` runs; answer for the general case then.
    """

    @property
    def model(self) -> ModelTraits | None:
        """The model's traits; ``None`` when selection runs without a model (``fdplug explain``)."""

    @property
    def model_dir(self) -> str | None: ...

    @property
    def dtype(self) -> str:
        """The compute dtype: float32, bfloat16 or float16 (or ``auto``, not yet resolved)."""

    @property
    def weight_dtype(self) -> str | None:
        """The float linears' storage dtype (bfloat16 where a float32 device keeps bf16 weights)."""

    @property
    def kv_cache_dtype(self) -> str: ...

    def kv_dtype(self) -> str:
        """The KV cache's element type (``kv_cache_dtype``, or the compute dtype for ``auto``)."""

    @property
    def quantization(self) -> str | None: ...

    @property
    def max_model_len(self) -> int | None: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def max_num_batched_tokens(self) -> int | None: ...

    @property
    def block_size(self) -> int: ...

    @property
    def num_kv_blocks(self) -> int | None: ...

    @property
    def seed(self) -> int: ...

    @property
    def device_index(self) -> int:
        """Which device of its kind this engine runs on (data parallel: rank i on device i)."""

    @property
    def expert_parallel_size(self) -> int: ...

    @property
    def kv_role(self) -> str | None:
        """``prefill`` or ``decode`` for one side of PD disaggregation, else ``None``."""

    @property
    def allowed_feature_paths(self) -> tuple[str, ...]:
        """The directories a ``file://`` feature URL may name (a feature storage's allow-list)."""

    @property
    def fetch_timeout(self) -> float:
        """Seconds a feature storage may take for one URL."""
