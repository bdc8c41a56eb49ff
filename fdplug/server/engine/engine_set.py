"""The engine processes of one server and what each is started with.

``--data-parallel-size N`` (and ``--expert-parallel-size N``) is N engine processes: each rank's
engine arguments and cores (`data_parallel_ranks`), its place in the expert-parallel group
(`expert_parallel_ranks`), and the processes themselves (`EngineSet`: local, or placed by Ray,
`ray_engines`). The API process's side of them is `fdplug.server.api.dp_client`.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

from fdplug.errors import ConfigError
from fdplug.server.engine.process import EngineProcess


def data_parallel_ranks(engine_args: dict, size: int, cpu: bool) -> list[tuple[dict, list[int] | None]]:
    """Each engine's arguments and cores: on the cpu device the usable cores split into ``size``
    contiguous shares (rank i's threads on share i: 2 cores, 2 engines: one core each; fewer cores
    than engines: one core each, shared round-robin), elsewhere device ``i`` for rank ``i``."""
    if size < 1:
        raise ConfigError(f"--data-parallel-size must be at least 1, got {size}.", fix="use 1 (one engine) or more.")
    if size == 1:
        return [(dict(engine_args), None)]
    if not cpu:
        return [({**engine_args, "device_index": rank}, None) for rank in range(size)]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < size:
        return [(dict(engine_args), [cores[rank % len(cores)]]) for rank in range(size)]
    return [(dict(engine_args), cores[rank * len(cores) // size:(rank + 1) * len(cores) // size])
            for rank in range(size)]


def expert_parallel_ranks(model_config: Any, size: int) -> list[dict] | None:
    """Each engine's place in the expert-parallel group (None: no group): rank, size, and the
    rendezvous endpoints (free ports on this machine; rank 0's hosts the group's store)."""
    if size == 1:
        return None
    moe = model_config.moe
    if moe is None:
        raise ConfigError(f"--expert-parallel-size {size} shards a MoE model's experts, and "
                          f"{model_config.architecture} has none.", fix="use --data-parallel-size for a dense model.")
    if moe.num_experts % size:
        raise ConfigError(f"{moe.num_experts} experts do not split evenly over --expert-parallel-size {size}.",
                          fix=f"choose a size that divides {moe.num_experts}.")
    endpoints = [f"127.0.0.1:{port}" for port in free_ports(size)]
    return [{"rank": rank, "size": size, "endpoints": endpoints} for rank in range(size)]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now (held together while chosen)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class EngineSet:
    """The engine processes of one server, local (``mp``) or placed by Ray (``ray``, `ray_engines`);
    `make` starts rank ``i``'s engine (again, for a restart)."""

    def __init__(self, spec_args: list[dict], log_level: int, backend: str = "mp",
                 ray_address: str | None = None) -> None:
        if backend not in ("mp", "ray"):
            raise ConfigError(f"--data-parallel-backend must be mp or ray, got {backend!r}.",
                              fix="mp: engine processes on this machine; ray: placed by Ray (--ray-address).")
        self.spec_args, self.log_level = spec_args, log_level
        self.cluster = None
        if backend == "ray":
            from fdplug.server.engine.ray_engines import RayCluster

            device = spec_args[0]["selection"]["device"]
            self.cluster = RayCluster(len(spec_args), ray_address, device)
            if device != "cpu":    # each engine's device on its node, as Ray placed them
                self.spec_args = spec_args = [{**args, "engine_args": {**args["engine_args"], "device_index": index}}
                                              for args, index in zip(spec_args, self.cluster.device_index)]
            if spec_args[0].get("expert_parallel"):     # the group meets on rank 0's node, not this one
                endpoints = self.cluster.rendezvous(len(spec_args))
                self.spec_args = spec_args = [{**args, "expert_parallel": {**args["expert_parallel"],
                                                                           "endpoints": endpoints}}
                                              for args in spec_args]
        self.engines: list[EngineProcess] = []
        try:
            for rank in range(len(spec_args)):
                self.engines.append(self.make(rank))
        except BaseException:   # the ones started must not outlive a failed start
            for engine in self.engines:
                engine.kill()
            if self.cluster is not None:
                self.cluster.shutdown()
            raise

    def make(self, rank: int) -> EngineProcess:
        if self.cluster is not None:
            return self.cluster.engine(self.spec_args[rank], self.log_level, rank)
        return EngineProcess(self.spec_args[rank], self.log_level)

    async def stop(self, timeout: float) -> list[int | None]:
        try:
            return list(await asyncio.gather(*(engine.stop(timeout) for engine in self.engines)))
        finally:
            if self.cluster is not None:
                self.cluster.shutdown()
