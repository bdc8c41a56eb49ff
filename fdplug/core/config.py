"""The engine's configuration: `EngineConfig` (plugins read it as `fdplug.plugin_api.engine_config.EngineView`).

Environment variables are read through `fdplug.plugin_api.settings` (the core's own are declared in
`fdplug.core.settings`); this module only holds the objects the engine and plugins are handed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fdplug.core.kv_endpoints import check_kv_fields
from fdplug.core.settings import env
from fdplug.errors import ConfigError
from fdplug.plugin_api.engine_config import ModelTraits

QUANTIZATIONS = ("fp8",)
"""What ``quantization=`` / ``--quantization`` accept: a float checkpoint quantized while it loads."""


@dataclass(slots=True)
class EngineConfig:
    """Engine settings, with vLLM's names where the concept is the same.

    Plugins read it through ``supports(config)``, their factories and ``fdplug_configure``, as the
    read-only `EngineView`; the core resolves its ``None`` and ``auto`` fields while it selects and
    sizes the engine, and treats it as read-only after that. ``None`` means "derive it": ``max_model_len`` from the
    model (capped by ``DEFAULT_MAX_MODEL_LEN``), ``max_num_batched_tokens`` from chunked prefill,
    the KV cache size from ``kv_cache_memory`` (GiB) unless ``num_kv_blocks`` is given.
    """

    model: ModelTraits | None = None
    model_dir: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory: float | None = None
    max_waiting_requests: int = 1024
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"      # the KV cache's element type; auto: the compute dtype (`kv_dtype`)
    quantization: str | None = None
    weight_dtype: str | None = None   # derived with dtype: bfloat16 where a float32 device keeps bf16 weights
    seed: int = 0
    device_index: int = 0             # which device of its kind (data parallel: rank i runs on device i)
    expert_parallel_size: int = 1     # > 1: this engine is one rank of an expert-parallel group (`fdplug serve`)
    kv_role: str | None = None        # prefill | decode: one side of PD disaggregation (`core.kv_transfer`)
    kv_port: int | None = field(default_factory=lambda: env("FDPLUG_KV_PORT"))      # prefill: where decode pulls
    kv_peers: tuple[str, ...] = field(default_factory=lambda: env("FDPLUG_KV_PEERS"))  # decode: whom it pulls from
    encoder_cache_rows: int = 16384
    feature_fetch_workers: int = field(default_factory=lambda: env("FD_PREFILL_PREPARE_REQ_THREAD_NUM"))
    allowed_feature_paths: tuple[str, ...] = field(default_factory=lambda: env("FDPLUG_ALLOWED_FEATURE_PATHS"))
    fetch_timeout: float = field(default_factory=lambda: env("FDPLUG_FETCH_TIMEOUT"))

    DEFAULT_MAX_MODEL_LEN = 8192
    DEFAULT_KV_CACHE_GIB = 2.0
    DTYPES = ("auto", "float32", "bfloat16", "float16")

    def kv_dtype(self) -> str:
        """The KV cache's element type: ``kv_cache_dtype``, or the compute dtype for ``auto`` (after
        selection has resolved ``dtype``). Attention computes in the compute dtype whatever the cache's."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                     "max_waiting_requests", "feature_fetch_workers", "expert_parallel_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}.",
                                  fix=f"give {name} an integer >= 1, or leave it unset for the default.")
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}.",
                              fix="use 16 (the default) or another power of two such as 32 or 64.")
        if self.kv_role not in (None, "prefill", "decode"):
            raise ConfigError(f"kv_role must be prefill or decode, got {self.kv_role!r}.",
                              fix="leave it unset for an instance that does both.")
        self.kv_port, self.kv_peers = check_kv_fields(self.kv_port, self.kv_peers)   # `core.kv_endpoints`
        if not isinstance(self.device_index, int) or isinstance(self.device_index, bool) or self.device_index < 0:
            raise ConfigError(f"device_index must be an integer >= 0, got {self.device_index!r}.",
                              fix="give the index of the device among those of its kind (0: the first).")
        if not isinstance(self.encoder_cache_rows, int) or self.encoder_cache_rows < 0:
            raise ConfigError(f"encoder_cache_rows must be an integer >= 0, got {self.encoder_cache_rows!r}.",
                              fix="give the encoder cache size in feature rows; 0 keeps nothing once used.")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ConfigError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}.",
                              fix="give the KV cache size in GiB, e.g. 2, or set num_kv_blocks.")
        if self.dtype not in self.DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(self.DTYPES)}, got {self.dtype!r}.",
                              fix="use auto (the device's compute dtype) or name one.")
        if self.kv_cache_dtype not in self.DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(self.DTYPES)}, got {self.kv_cache_dtype!r}.",
                              fix="use auto (the compute dtype) or float16 / bfloat16 (half the cache's bytes, "
                                  "as llama.cpp's default float16 cache).")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or unset, "
                              f"got {self.quantization!r}.",
                              fix="use quantization='fp8' (--quantization fp8) to quantize a float checkpoint's "
                                  "linear layers to FP8 blocks at load, or leave it unset.")
        if self.fetch_timeout <= 0:
            raise ConfigError(f"fetch_timeout must be > 0 seconds, got {self.fetch_timeout}.",
                              fix="give a positive number of seconds, e.g. 30.")
