"""Configuration: the one place environment variables are read, and the config objects.

Every environment variable fdplug (or a built-in plugin) reads is declared here with its default and
meaning, so `fdplug doctor` can list them and nothing reads ``os.environ`` behind the user's back.
Names follow FastDeploy where the concept is the same.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from fdplug.errors import ConfigError

# ---------------------------------------------------------------------------------------------------
# environment variables
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One environment variable: how to parse it and what it means."""

    name: str
    default: Any
    parse: Callable[[str], Any]
    help: str
    secret: bool = False
    as_set_by_user: bool = False


# Variables that libraries also write (``import paddle`` sets OMP_NUM_THREADS=1 when it is unset) are
# read as they were when fdplug was imported, so a library's write is not mistaken for the user's.
_PADDLE_IMPORTED_FIRST = "paddle" in sys.modules
_STARTUP_ENV = dict(os.environ)


def _parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 1/0/true/false, got {raw!r}")


def _parse_list(raw: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def _parse_paths(raw: str) -> tuple[str, ...]:
    return tuple(item for item in raw.split(os.pathsep) if item)


def _parse_positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def _parse_choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {raw!r}")
        return value
    return parse


def _parse_slice_us(raw: str) -> int:
    value = int(raw)
    if value != 0 and not 100 <= value <= 100_000:
        raise ValueError(f"must be 0 (the kernel's default) or 100-100000 microseconds, got {value}")
    return value


def _parse_positive_float(raw: str) -> float:
    value = float(raw)
    if value <= 0:
        raise ValueError(f"must be > 0, got {value}")
    return value


ENV_VARS: dict[str, EnvVar] = {}


def declare(name: str, default: Any, parse: Callable[[str], Any], help: str, *, secret: bool = False,
            as_set_by_user: bool = False) -> None:
    """Declare an environment variable. Built-in plugins declare theirs here too."""
    ENV_VARS[name] = EnvVar(name, default, parse, help, secret, as_set_by_user)


declare("FDPLUG_PLUGINS", None, _parse_list,
        "Comma-separated allow-list of third-party plugins to load (unset: all installed).")
declare("FDPLUG_DISABLE_PLUGINS", (), _parse_list,
        "Comma-separated deny-list of plugins (built-ins included) not to load.")
declare("FDPLUG_STRICT_PLUGINS", False, _parse_bool,
        "1: any plugin that fails to import or register is a fatal error.")
declare("FDPLUG_CPU_THREADS", None, _parse_positive_int,
        "Threads for CPU compute (default: the number of usable cores).")
declare("FDPLUG_CPU_MALLOC_TUNING", True, _parse_bool,
        "1 (default): the cpu device makes glibc keep freed memory (no mmap per large tensor); 0: leave malloc alone.")
declare("FDPLUG_CPU_KERNELS", "auto", _parse_choice("auto", "on", "off"),
        "The cpu device's compiled kernels (paged attention read in place; built once with the system C compiler "
        "into FDPLUG_CACHE_DIR): auto (default) uses them if they build, on requires them, off keeps plain Paddle.")
declare("CC", None, str, "C compiler for the cpu device's kernels (default: cc, then gcc, then clang on PATH).")
declare("OMP_NUM_THREADS", None, _parse_positive_int,
        "Honoured if set before fdplug and paddle are imported: the cpu device then uses that many threads.",
        as_set_by_user=True)
declare("MKL_DEBUG_CPU_TYPE", None, str,
        "Honoured if set; otherwise the cpu device sets 5 on AMD CPUs (MKL's fast AVX2 path).",
        as_set_by_user=True)
declare("KMP_BLOCKTIME", None, str,
        "Honoured if set; otherwise the cpu device sets 0 so MKL's idle threads sleep instead of spinning for "
        "200 ms (they took the cores from the compiled attention kernel's threads).", as_set_by_user=True)
declare("FDPLUG_ALLOWED_FEATURE_PATHS", (), _parse_paths,
        "os.pathsep-separated directories that file:// feature URLs may read from (default: none).")
declare("FDPLUG_ALLOW_PICKLE_FEATURES", False, _parse_bool,
        "1: accept Python pickle features (FastDeploy's format). Trusted sources only.")
declare("FD_PREFILL_PREPARE_REQ_THREAD_NUM", 4, _parse_positive_int,
        "Threads that fetch multimodal features for requests, off the step loop (FastDeploy's name).")
declare("FDPLUG_FETCH_TIMEOUT", 30.0, _parse_positive_float,
        "Seconds one feature fetch may take before it fails.")
# feature storage
declare("FD_BOS_DOWNLOAD_PARALLEL", 8, _parse_positive_int,
        "Parallel BOS feature downloads per request (1: sequential). FastDeploy's name.")
declare("FDPLUG_BOS_MAX_RETRIES", 3, int,
        "Retries per BOS feature after a throttling, 5xx or connection error (0: none); never after 403/404.")
declare("FDPLUG_BOS_RETRY_DEADLINE", 60.0, _parse_positive_float,
        "Seconds one BOS feature may spend in retries (backoff included) before it fails.")
declare("FDPLUG_BOS_ENDPOINT", None, str,
        "BOS endpoint for bos:// features, e.g. bj.bcebos.com (overrides ENCODE_FEATURE_ENDPOINT).")
declare("FDPLUG_BOS_AK", None, str, "BOS access key id (overrides ENCODE_FEATURE_BOS_AK).", secret=True)
declare("FDPLUG_BOS_SK", None, str, "BOS secret access key (overrides ENCODE_FEATURE_BOS_SK).", secret=True)
declare("FDPLUG_BOS_STS_TOKEN", None, str, "BOS STS session token, with temporary AK/SK.", secret=True)
declare("ENCODE_FEATURE_ENDPOINT", None, str, "BOS endpoint for bos:// features (FastDeploy's name).")
declare("ENCODE_FEATURE_BOS_AK", None, str, "BOS access key id (FastDeploy's name).", secret=True)
declare("ENCODE_FEATURE_BOS_SK", None, str, "BOS secret access key (FastDeploy's name).", secret=True)
declare("FDPLUG_HTTP_FEATURE_MAX_BYTES", 256 * 1024 * 1024, _parse_positive_int,
        "Largest http(s):// feature accepted, in bytes (enforced while streaming).")
declare("FDPLUG_ALLOWED_FEATURE_HOSTS", (), _parse_list,
        "Comma-separated hosts (host, host:port or *.domain) http(s):// features may come from (default: none).")
declare("FDPLUG_CACHE_DIR", None, str, "Directory for fdplug's generated files, e.g. the demo model (default: ~/.cache/fdplug).")
# server
declare("FDPLUG_API_KEY", None, str,
        "API key `fdplug serve` requires as `Authorization: Bearer KEY` (--api-key overrides; unset: no key).",
        secret=True)
declare("FDPLUG_ENGINE_STARTUP_TIMEOUT", 600.0, _parse_positive_float,
        "Seconds `fdplug serve` waits for the engine process to load the model and report ready.")
declare("FDPLUG_SHUTDOWN_TIMEOUT", 5.0, _parse_positive_float,
        "Seconds `fdplug serve` waits for responses and the engine process to finish when stopping.")
declare("FDPLUG_ENGINE_STALL_TIMEOUT", 600.0, _parse_positive_float,
        "Seconds the engine may send nothing while requests are in flight before `fdplug serve` kills it as hung.")
declare("FDPLUG_ENGINE_SLICE_US", 100, _parse_slice_us,
        "Scheduler slice the engine process asks Linux (6.12+) for, in microseconds: short, so its compute threads "
        "preempt the API process on the shared cores instead of waiting out its slice; 0 keeps the kernel's default.")
declare("FDPLUG_EVENT_LOOP", "auto", _parse_choice("auto", "uvloop", "asyncio"),
        "The API process's event loop: auto (default) uses uvloop where it is installed (a dependency on Linux "
        "and macOS: its C sockets cost about a fifth less CPU per streamed token), else asyncio's.")


def env(name: str) -> Any:
    """The parsed value of a declared environment variable, or its default when unset.

    A malformed value is a ConfigError naming the variable, not a crash deep in the code.
    """
    var = ENV_VARS[name]
    raw = _raw(var)
    if raw is None:
        return var.default
    try:
        return var.parse(raw)
    except ValueError as exc:
        shown = "<hidden>" if var.secret else repr(raw)
        raise ConfigError(f"environment variable {name}={shown} is invalid: {exc}.",
                          fix=f"{var.help} Unset it or give a valid value.") from None


def env_is_set(name: str) -> bool:
    """Whether the user set a declared variable (even to an empty string)."""
    if name not in ENV_VARS:
        raise KeyError(f"{name} is not declared in fdplug.core.config")
    return _raw(ENV_VARS[name]) is not None


def _raw(var: EnvVar) -> str | None:
    if not var.as_set_by_user:
        return os.environ.get(var.name)
    if _PADDLE_IMPORTED_FIRST and var.name == "OMP_NUM_THREADS":
        return None  # paddle may have written it: its origin is unknown
    return _STARTUP_ENV.get(var.name)


# ---------------------------------------------------------------------------------------------------
# config objects
# ---------------------------------------------------------------------------------------------------


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
    num_experts: int = 0
    moe_weight_format: str = "none"
    mask_policy: str = "causal"


@dataclass(slots=True)
class EngineConfig:
    """Engine settings, with vLLM's names where the concept is the same.

    Backends see it through ``supports(config)`` and ``fdplug_configure``; it is mutable on purpose
    so ``fdplug_configure`` may adjust it for the chosen backend before the engine starts; after
    that the engine treats it as read-only. ``None`` means "derive it": ``max_model_len`` from the
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
    seed: int = 0
    encoder_cache_rows: int = 16384
    feature_fetch_workers: int = field(default_factory=lambda: env("FD_PREFILL_PREPARE_REQ_THREAD_NUM"))
    allowed_feature_paths: tuple[str, ...] = field(default_factory=lambda: env("FDPLUG_ALLOWED_FEATURE_PATHS"))
    fetch_timeout: float = field(default_factory=lambda: env("FDPLUG_FETCH_TIMEOUT"))

    DEFAULT_MAX_MODEL_LEN = 8192
    DEFAULT_KV_CACHE_GIB = 2.0
    DTYPES = ("auto", "float32", "bfloat16", "float16")

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                     "max_waiting_requests", "feature_fetch_workers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}.",
                                  fix=f"give {name} an integer >= 1, or leave it unset for the default.")
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}.",
                              fix="use 16 (the default) or another power of two such as 32 or 64.")
        if not isinstance(self.encoder_cache_rows, int) or self.encoder_cache_rows < 0:
            raise ConfigError(f"encoder_cache_rows must be an integer >= 0, got {self.encoder_cache_rows!r}.",
                              fix="give the encoder cache size in feature rows; 0 keeps nothing once used.")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ConfigError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}.",
                              fix="give the KV cache size in GiB, e.g. 2, or set num_kv_blocks.")
        if self.dtype not in self.DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(self.DTYPES)}, got {self.dtype!r}.",
                              fix="use auto (the device's compute dtype) or name one.")
        if self.fetch_timeout <= 0:
            raise ConfigError(f"fetch_timeout must be > 0 seconds, got {self.fetch_timeout}.",
                              fix="give a positive number of seconds, e.g. 30.")
