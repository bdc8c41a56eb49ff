"""The scheduler's limits, checked together when the engine starts (each error says how to fix it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fdplug.errors import ConfigError, QueueFullError
from fdplug.plugin_api.attention import cdiv

if TYPE_CHECKING:
    from fdplug.core.config import EngineConfig


@dataclass(slots=True)
class SchedulerConfig:
    """Scheduling limits. ``num_kv_blocks`` counts the null block; it comes from memory profiling."""

    max_model_len: int
    num_kv_blocks: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_waiting_requests: int = 1024

    @classmethod
    def from_engine_config(cls, config: EngineConfig, num_kv_blocks: int) -> SchedulerConfig:
        """The engine's settings (resolved by ``startup.build_engine_config``) and the KV cache the
        runner allocated: the one place the scheduler's limits come from."""
        return cls(max_model_len=config.max_model_len, num_kv_blocks=num_kv_blocks,
                   max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                   block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                   enable_chunked_prefill=config.enable_chunked_prefill,
                   max_waiting_requests=config.max_waiting_requests)

    def __post_init__(self) -> None:
        for name in ("max_model_len", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "block_size", "max_waiting_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}.",
                                  fix=f"set {name} to an integer >= 1.")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}.",
                              fix="use 16 (the default) or another power of two such as 32 or 64.")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2 (a prompt token and an output token), "
                              f"got {self.max_model_len}.", fix="raise max_model_len.")
        needed = cdiv(self.max_model_len, self.block_size) + 1
        if self.num_kv_blocks < needed:
            raise ConfigError(
                f"the KV cache has {self.num_kv_blocks} blocks of {self.block_size} tokens; one request "
                f"of max_model_len={self.max_model_len} needs {needed} (with the null block).",
                fix=f"lower max_model_len to at most {(self.num_kv_blocks - 1) * self.block_size} "
                    f"or give the KV cache more memory.")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is below max_num_seqs "
                f"({self.max_num_seqs}): the running requests could not all decode in one step.",
                fix=f"set max_num_batched_tokens >= {self.max_num_seqs} or lower max_num_seqs.")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"with chunked prefill disabled, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}), or long prompts could never run.",
                fix=f"set max_num_batched_tokens >= {self.max_model_len}, lower max_model_len, "
                    f"or enable chunked prefill.")

    def check_queue_room(self, waiting: int) -> None:
        """A QueueFullError when ``waiting`` requests already fill the waiting queue."""
        if waiting >= self.max_waiting_requests:
            raise QueueFullError(f"the engine has {waiting} requests waiting, its limit (max_waiting_requests).",
                                 fix="retry later, or raise max_waiting_requests if the server has memory to spare.")
