"""Stopping without failing the users: SIGTERM drains, a second signal (or the timeout) aborts.

A rolling update sends SIGTERM to a server with answers half-streamed. Ending them at once fails
every user mid-answer; so the first signal only closes the door: new requests and ``/health`` get a
503 (a load balancer's probe takes the instance out of rotation) while the requests in flight run
to their end, for at most ``--shutdown-timeout`` seconds. What is left then is aborted (each
stream ends with an error event, each waiting client gets a 503) and the process exits 0. A second
signal skips the wait. ``fdplug serve`` (single or data-parallel engines) and ``fdplug router``
share this; each says what "in flight" is and how to abort it.

Why 25 s by default (``settings.DEFAULT_SHUTDOWN_TIMEOUT_S``): Kubernetes sends SIGKILL
``terminationGracePeriodSeconds`` (30 s by default)
after SIGTERM; 25 s of draining leaves the rest of the stop (2 s for the last writes, then the
engines' exit, well under a second when they are idle) inside it. Most chat answers finish within
it; set it (and the pod's grace period) higher for long generations.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from fdplug.errors import ServerShuttingDownError
from fdplug.server.http.connection_guard import uvicorn_kwargs
from fdplug.server.http.limits import ConnectionLimits

logger = logging.getLogger("fdplug.server")

GRACE_AFTER_DRAIN_S = 2     # uvicorn's wait for responses still being written once the drain is over
POLL_S = 0.05


class Drain:
    """The graceful stop of one HTTP front: ``begin`` on the first signal, ``force`` on the second.

    "In flight" is every request the front's `Guard` let in and has not answered to the end, from
    its first byte (a body still uploading, a prompt being tokenized, a relay waiting for prefill)
    to its last (a stream's ``[DONE]``); ``/health``, ``/metrics`` and ``/version`` do not count.
    """

    def __init__(self, timeout: float, abort_rest: Callable[[], None], what: str = "requests") -> None:
        """``abort_rest()``: end what still runs now, with an error each (a 503, or a stream's error event)."""
        self.timeout = timeout
        self.abort_rest = abort_rest
        self.what = what
        self.active = 0                                # requests in flight (the `Guard` counts them)
        self.server: uvicorn.Server | None = None     # set once it runs: `_stop` makes it exit
        self.draining = False
        self.aborting = asyncio.Event()   # the timeout (or a second signal) came: what runs is being ended
        self._task: asyncio.Task | None = None

    def refusal(self) -> ServerShuttingDownError:
        """New requests while draining: a 503 (retry elsewhere), never a half-served answer."""
        return ServerShuttingDownError("the server is shutting down and takes no new requests.",
                                       fix="retry against another instance (or once this one is back).")

    def begin(self) -> None:
        """Stop taking requests; let those in flight finish within the timeout (on the event loop)."""
        if self.draining:
            return
        self.draining = True
        logger.info("draining: %d %s in flight, up to %g s (--shutdown-timeout); a second signal stops at once",
                    self.active, self.what, self.timeout)
        self._task = asyncio.get_running_loop().create_task(self._drain(), name="fdplug-drain")

    def force(self) -> None:
        """Abort whatever is still running and stop now, without uvicorn's wait for open connections."""
        self.draining = True
        if self._task is not None:
            self._task.cancel()
        if self.server is not None:
            self.server.force_exit = True
        self._stop(abort=True)

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if self.active:
            logger.warning("shutdown timeout: aborting %d %s still in flight", self.active, self.what)
        else:
            logger.info("drained: no %s in flight", self.what)
        self._stop(abort=bool(self.active))

    def _stop(self, abort: bool) -> None:
        if abort:
            self.aborting.set()
            self.abort_rest()
        if self.server is not None:
            self.server.should_exit = True


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with signals that drain (`Drain`) instead of cutting requests off.

    uvicorn's own first signal stops accepting and then waits; its second kills. Here the first
    keeps the socket open (new requests get their 503 instead of a refused connection, and
    ``/health`` says so) and the second aborts what is left. uvicorn also re-raises the caught
    signal after shutting down (the process dies *by* SIGTERM, status -15), which a service
    manager reads as a crash: here a signal is a normal stop, status 0.
    """

    def __init__(self, app: Any, drain: Drain, loop: asyncio.AbstractEventLoop, limits: ConnectionLimits,
                 **where: Any) -> None:
        """``app`` on uvicorn with the per-connection ``limits``, quiet (the app logs), no lifespan;
        ``where``: uvicorn's ``host``/``port`` when it binds its own socket."""
        super().__init__(uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                        timeout_graceful_shutdown=GRACE_AFTER_DRAIN_S, **uvicorn_kwargs(limits),
                                        **where))
        self.drain = drain
        self.loop = loop
        self.signalled = False
        drain.server = self

    def handle_exit(self, sig: int, frame: Any) -> None:
        name = signal.Signals(sig).name
        if self.signalled:
            logger.info("%s again: stopping now", name)
            self.loop.call_soon_threadsafe(self.drain.force)
            return
        self.signalled = True
        logger.info("%s: stopping", name)
        self.loop.call_soon_threadsafe(self.drain.begin)

