"""Data-parallel engines placed by Ray: ``fdplug serve --data-parallel-backend ray [--ray-address A]``.

Ray places and supervises; the engines themselves are the same ``engine_process`` as local ones,
speaking the same msgpack protocol to the API process, over TCP instead of IPC (CURVE-encrypted:
an engine gets the API's public key through Ray, and a peer without it cannot connect). A
placement group reserves one bundle of CPUs per engine (``SPREAD``: on different machines where
the cluster has them); each engine is started by a small actor (`EngineActor`) in its bundle,
which is the engine process's parent, so Ray killing the actor ends the engine with it. Without
``--ray-address`` a local Ray is started (a one-machine cluster); with it, this process joins the
cluster as a driver, and every node needs the same fdplug installed.

Restarts: the API process restarts a dead engine (a new actor in the same bundle) up to
``dp_client.MAX_RESTARTS`` times per rank; its requests have failed by then. Ray reserves CPUs
only: engines on accelerators are not placed per device by this backend yet.

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
from fdplug.server.engine_handle import EngineProcess

logger = logging.getLogger("fdplug.server")

ACTOR_CALL_TIMEOUT_S = 10.0


class EngineActor:
    """Runs inside a Ray worker on the engine's node: starts the engine process, reports on it."""

    def start(self, spec_json: str, threads: int) -> int:
        spec = json.loads(spec_json)
        spec["parent_pid"] = os.getpid()     # the engine exits when this actor does
        environ = dict(os.environ, FDPLUG_CPU_THREADS=str(threads))
        self.popen = subprocess.Popen([sys.executable, "-m", "fdplug.server.engine_process", json.dumps(spec)],
                                      env=environ, stdin=subprocess.DEVNULL)
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, kill: bool) -> None:
        if self.popen.poll() is None:
            (self.popen.kill if kill else self.popen.terminate)()


class RayEngineProcess(EngineProcess):
    """`EngineProcess` whose engine runs in bundle ``bundle`` of ``group`` (a Ray placement group)."""

    def __init__(self, spec_args: dict, log_level: int, host: str, group: Any, bundle: int, threads: int) -> None:
        self.group, self.bundle, self.threads = group, bundle, threads
        super().__init__(spec_args, log_level, tcp_host=host)

    def _spawn(self, spec: Any) -> int:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                    placement_group_bundle_index=self.bundle)
        self.actor = ray.remote(EngineActor).options(num_cpus=self.threads, scheduling_strategy=strategy).remote()
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

    def __init__(self, size: int, address: str | None) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
        except ImportError:
            raise ConfigError("--data-parallel-backend ray needs Ray, which is not installed.",
                              fix="pip install 'ray>=2.40' (on every node), or use --data-parallel-backend mp.") from None
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                 configure_logging=False, namespace="fdplug")
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.threads = max(1, cpus // size)     # each engine's share of the cluster's CPUs
        self.host = "127.0.0.1" if address is None else ray.util.get_node_ip_address()
        self.group = placement_group([{"CPU": self.threads}] * size, strategy="SPREAD")
        try:
            ray.get(self.group.ready(), timeout=60)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(f"Ray could not place {size} engines of {self.threads} CPUs each within 60 s "
                              f"(the cluster has {cpus} CPUs).",
                              fix="add nodes or lower --data-parallel-size.") from None
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
        return RayEngineProcess(spec_args, log_level, self.host, self.group, rank, self.threads)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.group)
        finally:
            ray.shutdown()
