"""Data-parallel engines placed by Ray: ``fdplug serve --data-parallel-backend ray [--ray-address A]``.

Ray places and supervises; the engines themselves are the same engine process (`engine.main`) as local ones,
speaking the same msgpack protocol to the API process, over TCP instead of IPC (CURVE-encrypted:
an engine gets the API's public key through Ray, and a peer without it cannot connect). A
placement group reserves one bundle of CPUs per engine (``SPREAD``: on different machines where
the cluster has them); each engine is started by a small actor (`EngineActor`) in its bundle,
which is the engine process's parent, so Ray killing the actor ends the engine with it. Without
``--ray-address`` a local Ray is started (a one-machine cluster); with it, this process joins the
cluster as a driver, and every node needs the same fdplug installed.

Restarts: the API process restarts a dead engine (a new actor in the same bundle) up to
``dp_client.MAX_RESTARTS`` times per rank; its requests have failed by then.

Accelerators (`engine_bundles`): on the cpu device a bundle is the engine's share of the cluster's
CPUs; otherwise one device and one CPU: Ray's ``GPU`` for cuda (Ray then makes that one GPU the
actor's, ``CUDA_VISIBLE_DEVICES``, so the engine runs on its device 0), a custom resource named
after the device for the others (``XPU``: start each node with ``ray start --resources
'{"XPU": 8}'``), whose engines take their ordinal among the bundles on their node as device index.

Expert parallel (``--expert-parallel-size``): the engines' paddle.distributed group meets at a free
port on rank 0's node (`RayCluster.rendezvous`, asked of its bundle before the engines start); an
engine of the group is not restarted alone (the group runs as one).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any

from fdplug.errors import ConfigError
from fdplug.server.engine.process import EngineProcess

logger = logging.getLogger("fdplug.server")

ACTOR_CALL_TIMEOUT_S = 10.0
RAY_RESOURCE = {"cuda": "GPU"}     # Ray's own resource names; other accelerators: the device's name, upper case


def engine_bundles(size: int, cluster_cpus: int, device: str) -> tuple[list[dict], int]:
    """Each engine's placement-group bundle, and its threads: on cpu the cluster's CPUs split over
    the engines; on an accelerator one device of it and one CPU."""
    if device == "cpu":
        threads = max(1, cluster_cpus // size)
        return [{"CPU": threads} for _ in range(size)], threads
    return [{"CPU": 1, RAY_RESOURCE.get(device, device.upper()): 1} for _ in range(size)], 1


def device_indices(bundle_nodes: list[str], device: str) -> list[int]:
    """Each engine's device index on its node: 0 for cuda (Ray isolates its one GPU) and cpu; for a
    custom resource, its ordinal among the bundles placed on the same node."""
    if device in ("cpu", "cuda"):
        return [0] * len(bundle_nodes)
    seen: dict[str, int] = {}
    out = []
    for node in bundle_nodes:
        out.append(seen.get(node, 0))
        seen[node] = out[-1] + 1
    return out


class EngineActor:
    """Runs inside a Ray worker on the engine's node: starts the engine process, reports on it."""

    def start(self, spec_json: str, threads: int) -> int:
        spec = json.loads(spec_json)
        spec["parent_pid"] = os.getpid()     # the engine exits when this actor does
        environ = dict(os.environ, FDPLUG_CPU_THREADS=str(threads))
        self.popen = subprocess.Popen([sys.executable, "-m", "fdplug.server.engine.main", json.dumps(spec)],
                                      env=environ, stdin=subprocess.DEVNULL)
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, kill: bool) -> None:
        if self.popen.poll() is None:
            (self.popen.kill if kill else self.popen.terminate)()


class RayEngineProcess(EngineProcess):
    """`EngineProcess` whose engine runs in bundle ``bundle`` of ``group`` (a Ray placement group)."""

    def __init__(self, spec_args: dict, log_level: int, host: str, group: Any, bundle: int, threads: int,
                 accelerator: dict | None = None) -> None:
        """``accelerator``: the bundle's device resource (``{"GPU": 1}``), which the actor holds."""
        self.group, self.bundle, self.threads, self.accelerator = group, bundle, threads, accelerator or {}
        super().__init__(spec_args, log_level, tcp_host=host)

    def _spawn(self, spec: Any) -> int:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                    placement_group_bundle_index=self.bundle)
        gpus = self.accelerator.get("GPU", 0)
        others = {name: n for name, n in self.accelerator.items() if name != "GPU"}
        self.actor = ray.remote(EngineActor).options(num_cpus=self.threads, num_gpus=gpus, resources=others or None,
                                                     scheduling_strategy=strategy).remote()
        return ray.get(self.actor.start.remote(spec.to_json(), self.threads), timeout=ACTOR_CALL_TIMEOUT_S * 6)

    def poll(self) -> int | None:
        import ray

        try:
            return ray.get(self.actor.poll.remote(), timeout=ACTOR_CALL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            return None                        # busy node: the stall watchdog decides
        except ray.exceptions.RayError:
            return -9                          # the actor (and with it the engine) is gone

    async def stop(self, timeout: float) -> int | None:
        """The engine as a local one stops, then its actor: the bundle's CPUs are free for a restart."""
        import ray

        code = await super().stop(timeout)
        ray.kill(self.actor, no_restart=True)
        return code

    def terminate(self) -> None:
        self._signal(kill=False)

    def kill(self) -> None:
        self._signal(kill=True)
        import ray

        ray.kill(self.actor)

    def _signal(self, kill: bool) -> None:
        import ray

        try:
            ray.get(self.actor.signal.remote(kill), timeout=ACTOR_CALL_TIMEOUT_S)
        except ray.exceptions.RayError:
            pass


def _node_endpoint() -> str:
    """This node's address and a port free on it now (run as a Ray task in a bundle)."""
    import socket

    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind((host, 0))
        return f"{host}:{sock.getsockname()[1]}"


class RayCluster:
    """The Ray connection and the placement group of ``size`` engines of ``threads`` CPUs each."""

    def __init__(self, size: int, address: str | None, device: str = "cpu") -> None:
        try:
            import ray
            from ray.util.placement_group import (
                placement_group,
                placement_group_table,
                remove_placement_group,
            )
        except ImportError:
            raise ConfigError("--data-parallel-backend ray needs Ray, which is not installed.",
                              fix="pip install 'ray>=2.40' (on every node), "
                                  "or use --data-parallel-backend mp.") from None
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                 configure_logging=False, namespace="fdplug")
        resources = ray.cluster_resources()
        cpus = int(resources.get("CPU", 1))
        bundles, self.threads = engine_bundles(size, cpus, device)
        self.accelerator = {name: n for name, n in bundles[0].items() if name != "CPU"}
        self.host = "127.0.0.1" if address is None else ray.util.get_node_ip_address()
        self.group = placement_group(bundles, strategy="SPREAD")
        try:
            ray.get(self.group.ready(), timeout=60)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.group)
            have = ", ".join(f"{int(resources.get(name, 0))} {name}" for name in ("CPU", *self.accelerator))
            raise ConfigError(f"Ray could not place {size} engines of {bundles[0]} each within 60 s (the cluster has "
                              f"{have}).", fix="add nodes (with `ray start --num-gpus N` or --resources '{\"XPU\": N}' "
                                               "for accelerators), or lower --data-parallel-size.") from None
        nodes = placement_group_table(self.group)["bundles_to_node_id"]
        self.device_index = device_indices([nodes[i] for i in range(size)], device)
        logger.info("Ray %s: %d engines of %d CPUs each in placement group %s", "local" if address is None else address,
                    size, self.threads, self.group.id.hex()[:8])

    def rendezvous(self, size: int) -> list[str]:
        """Expert parallel: an endpoint on each engine's node (rank 0's hosts the group's store)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        task = ray.remote(_node_endpoint)
        refs = [task.options(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=rank)).remote() for rank in range(size)]
        return ray.get(refs, timeout=ACTOR_CALL_TIMEOUT_S * 6)

    def engine(self, spec_args: dict, log_level: int, rank: int) -> RayEngineProcess:
        return RayEngineProcess(spec_args, log_level, self.host, self.group, rank, self.threads, self.accelerator)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.group)
        finally:
            ray.shutdown()
