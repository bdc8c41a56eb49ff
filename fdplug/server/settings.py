"""The server's environment variables (``fdplug serve``); read them with ``env(name)``."""

from __future__ import annotations

from fdplug.plugin_api.settings import (
    Setting,
    declare,
    env,
    env_is_set,
    parse_bool,
    parse_choice,
    parse_positive_float,
    parse_positive_int,
)

__all__ = ["env", "env_is_set"]


def parse_slice_us(raw: str) -> int:
    value = int(raw)
    if value != 0 and not 100 <= value <= 100_000:
        raise ValueError(f"must be 0 (the kernel's default) or 100-100000 microseconds, got {value}")
    return value


def parse_seconds(raw: str) -> float:
    value = float(raw)
    if not 0 <= value < float("inf"):
        raise ValueError(f"must be 0 or more seconds, got {value}")
    return value


def parse_window_seconds(raw: str) -> float:
    value = float(raw)
    if not 0 <= value <= 10:
        raise ValueError(f"must be 0 (no wait) to 10 seconds, got {value}")
    return value


DEFAULT_SHUTDOWN_TIMEOUT_S = 25.0   # why 25: `fdplug.server.http.drain`

for _setting in (
    Setting("FDPLUG_API_KEY", None, str,
            "API key `fdplug serve` requires as `Authorization: Bearer KEY` (--api-key overrides; unset: no key).",
            secret=True),
    Setting("FDPLUG_ENGINE_STARTUP_TIMEOUT", 600.0, parse_positive_float,
            "Seconds `fdplug serve` waits for the engine process to load the model and report ready."),
    Setting("FDPLUG_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT_S, parse_seconds,
            "Seconds `fdplug serve` and `fdplug router` let requests in flight finish after SIGTERM before aborting "
            "them (--shutdown-timeout overrides; 25: inside Kubernetes' default 30 s grace period; 0: no wait). "
            "It used to be the engine processes' stop timeout, FDPLUG_ENGINE_STOP_TIMEOUT now."),
    Setting("FDPLUG_ENGINE_STOP_TIMEOUT", 5.0, parse_positive_float,
            "Seconds an engine process has to exit after `fdplug serve` tells it to (then SIGTERM, then SIGKILL)."),
    Setting("FDPLUG_ENGINE_STALL_TIMEOUT", 600.0, parse_positive_float,
            "Seconds the engine may send nothing while requests are in flight before `fdplug serve` kills it as hung."),
    Setting("FDPLUG_ENGINE_SLICE_US", 100, parse_slice_us,
            "Scheduler slice the engine process asks Linux (6.12+) for, in microseconds: short, so its compute "
            "threads preempt the API process on the shared cores instead of waiting out its slice; 0 keeps the "
            "kernel's default."),
    Setting("FDPLUG_EVENT_LOOP", "auto", parse_choice("auto", "uvloop", "asyncio"),
            "The API process's event loop: auto (default) uses uvloop where it is installed (a dependency on Linux "
            "and macOS: its C sockets cost about a fifth less CPU per streamed token), else asyncio's."),
    Setting("FDPLUG_DP_PREFIX_AFFINITY", True, parse_bool,
            "1 (default): with --data-parallel-size > 1 a request prefers, among the engines within 2 requests of "
            "the least loaded, the one holding its prompt's prefix; 0: the least loaded engine only."),
    Setting("FDPLUG_ROUTER_MAX_CONNECTIONS", 4096, parse_positive_int,
            "fdplug router: most connections to the instances at once (each relay in flight holds one); past it a "
            "request waits 5 s for one, then gets a 503."),
    Setting("FDPLUG_ROUTER_PREFILL_TIMEOUT", 600.0, parse_positive_float,
            "fdplug router: seconds a prefill instance may take to answer a request (its prefill) before a 503."),
    Setting("FD_EP_BATCHED_TOKEN_TIMEOUT", 0.1, parse_window_seconds,
            "Expert parallel: seconds an idle rank waits for more requests (up to a step's tokens and its free KV "
            "blocks) before it starts a step that every rank must join (FastDeploy's name; 0: start at once)."),
):
    declare(_setting)
