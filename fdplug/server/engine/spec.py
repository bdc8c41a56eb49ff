"""What an engine process is started with: its ``EngineSpec``, as JSON on its command line.

The API process fills it in (`process.EngineProcess`, `ray_engines`); the engine process
(`main`) reads it back. Both sides import only this, not each other.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class EngineSpec:
    """Everything the engine process needs, as JSON on its command line."""

    input_address: str      # the API's PUSH socket: this process PULLs requests from it
    output_address: str     # the API's PULL socket: this process PUSHes outputs to it
    model_dir: str
    selection: dict           # Selection.to_names()
    engine_args: dict       # EngineConfig fields (vLLM names)
    parent_pid: int
    log_level: int = logging.WARNING
    scheduler_slice_us: int = 0   # FDPLUG_ENGINE_SLICE_US, read (and checked) by the API process; 0: kernel default
    cpus: list[int] | None = None # data parallel on the cpu device: the cores this engine runs on (its threads)
    curve_server_key: str | None = None   # TCP sockets (an engine on another machine): the API's CURVE public key
    # {"rank", "size", "endpoints": [host:port]}: a rank of an expert-parallel group
    expert_parallel: dict | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        return cls(**json.loads(text))
