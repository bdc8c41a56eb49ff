"""Data parallel serving: one API process in front of N engine processes, each with its own KV cache.

``fdplug serve --data-parallel-size N`` starts N engine processes (the same `engine.main` process as
one engine, each on its share of the cores or its own device: `fdplug.server.engine.engine_set`)
and one `EngineClient` per engine; this client gives the app the same face as a single
`EngineClient` (``add``, ``abort``, ``healthy``, ``metrics``...) and routes each request with
`dp_router.Router` (least loaded, then prefix affinity). Outputs never cross engines: a request
lives and ends on the engine it was sent to.

An engine that dies fails only its own requests (its client's watchdog ends them with an
``EngineDeadError``); the router stops sending it anything, ``/health`` lists it as dead and stays
200 while another engine serves, ``fdplug:engine_alive`` counts the live ones. When the last one
dies the server stops with status 1, as with one engine.

Expert parallel (``--expert-parallel-size N``): the N engines are also the ranks of one
paddle.distributed group that runs every forward pass together (`fdplug.core.parallel.lockstep`).
Routing is the same; each request also wakes the other engines (``lockstep``), so they join the
group's round without waiting out their idle poll. A rank that dies takes the group with it: the
others' next collective fails, and each fails its own requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fdplug.core.frontend.processor import ProcessedPrompt
from fdplug.errors import (
    EngineDeadError,
    EngineUnavailableError,
    FdplugError,
    InvalidRequestError,
)
from fdplug.plugin_api.sampling_params import SamplingParams
from fdplug.server.api.dp_router import Router
from fdplug.server.api.engine_client import EngineClient
from fdplug.server.api.request_stream import RequestStream
from fdplug.server.settings import env

logger = logging.getLogger("fdplug.server")

MAX_RESTARTS = 3     # per rank, where the backend restarts engines (Ray): one that keeps dying is left dead


class DataParallelClient:
    """``EngineClient``'s interface over several engine clients (rank = index in ``clients``)."""

    def __init__(self, clients: list[EngineClient],
                 restart: Callable[[int], Awaitable[EngineClient]] | None = None, lockstep: bool = False) -> None:
        """``restart(rank)``: a new engine and its client for a rank that died (None: dead stays dead);
        ``lockstep``: the engines are an expert-parallel group (wake the others on each request)."""
        self.clients = clients
        self.lockstep = lockstep
        self.restart = restart
        self.restarts = [0] * len(clients)
        first = clients[0]
        self.info, self.tokenizer, self.metrics = first.info, first.tokenizer, first.metrics
        self.input_processor = first.input_processor
        self.router = Router(len(clients), first.info.block_size, affinity=env("FDPLUG_DP_PREFIX_AFFINITY"))
        self.on_engine_dead: Callable[[], None] | None = None
        self._shutdown_error: FdplugError | None = None
        for rank, client in enumerate(clients):
            client.on_engine_dead = lambda rank=rank: self._engine_died(rank)

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        for client in self.clients:
            client.start()

    @property
    def healthy(self) -> bool:
        return self._shutdown_error is None and any(c.healthy for c in self.clients)

    @property
    def error(self) -> FdplugError | None:
        if self._shutdown_error is not None:
            return self._shutdown_error
        return None if self.healthy else self.clients[-1].error

    def engines(self) -> list[dict[str, Any]]:
        """Each engine's rank, pid, whether it runs, and its requests in flight (``/health``)."""
        return [{"rank": rank, **client.engine_status()} for rank, client in enumerate(self.clients)]

    def begin_shutdown(self) -> None:
        for client in self.clients:
            client.begin_shutdown()
        self._shutdown_error = self.clients[0].error

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    # -- requests ---------------------------------------------------------------------------------

    def add(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
            cache_salt: str | None = None, queue: Any = None, rank: int | None = None) -> RequestStream:
        """Queue a validated request on the engine the router picks (``rank``: an explicit choice)."""
        for _ in range(len(self.clients)):   # an engine may die between the choice and the send
            for i, client in enumerate(self.clients):
                self.router.engines[i].in_flight = client.num_registered()
                self.router.reported(i, client.num_waiting)
            chosen = self.router.choose(prompt.token_ids, cache_salt, rank)
            if chosen is None:
                break
            try:
                stream = self.clients[chosen].add(request_id, prompt, params, cache_salt, queue)
            except EngineDeadError:
                self.router.dead(chosen)
                if rank is not None:
                    break
                continue
            self.router.sent(chosen, prompt.token_ids, cache_salt)
            if self.lockstep:
                for other in self.clients:
                    if other is not self.clients[chosen] and other.healthy:
                        other.engine.wake()
            return stream
        if self._shutdown_error is not None:
            raise type(self._shutdown_error)(self._shutdown_error.message, fix=self._shutdown_error.fix)
        if rank is not None and not 0 <= rank < len(self.clients):
            raise InvalidRequestError(f"data-parallel rank {rank} is not one of this server's engines "
                                      f"(0..{len(self.clients) - 1}).",
                                      fix="leave X-Data-Parallel-Rank out, or name an engine that exists.",
                                      param="X-Data-Parallel-Rank")
        if rank is not None:
            raise EngineUnavailableError(f"data-parallel engine {rank} is not running.",
                                         fix="leave X-Data-Parallel-Rank out (another engine serves), or retry later.")
        raise EngineDeadError("no data-parallel engine is running.",
                              fix="see the server log for why the engines exited, then restart `fdplug serve`.")

    def abort(self, request_id: str) -> None:
        for client in self.clients:
            client.abort(request_id)

    def num_registered(self) -> int:
        return sum(client.num_registered() for client in self.clients)

    # -- engines ----------------------------------------------------------------------------------

    def _engine_died(self, rank: int) -> None:
        self.router.dead(rank)
        alive = sum(client.healthy for client in self.clients)
        logger.error("data-parallel engine %d died; %d of %d still serving", rank, alive, len(self.clients))
        if self.restart is not None and self._shutdown_error is None and self.restarts[rank] < MAX_RESTARTS:
            self.restarts[rank] += 1
            asyncio.get_running_loop().create_task(self._restart(rank), name=f"fdplug-restart-engine-{rank}")
        elif alive == 0 and self.on_engine_dead is not None:
            self.on_engine_dead()

    async def _restart(self, rank: int) -> None:
        logger.warning("restarting data-parallel engine %d (restart %d of at most %d)", rank, self.restarts[rank],
                       MAX_RESTARTS)
        try:
            client = await self.restart(rank)
        except Exception:
            # a failed restart leaves the rank dead, logged
            logger.exception("data-parallel engine %d could not be restarted", rank)
            if not self.healthy and self.on_engine_dead is not None:
                self.on_engine_dead()
            return
        if self._shutdown_error is not None:
            client.begin_shutdown()
            return
        await self.clients[rank].close()
        client.on_engine_dead = lambda: self._engine_died(rank)
        self.clients[rank] = client
        client.start()
        self.router.revived(rank)
        logger.info("data-parallel engine %d is back (pid %d)", rank, client.engine.pid)
