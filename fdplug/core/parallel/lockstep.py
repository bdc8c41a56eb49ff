"""The ranks of an expert-parallel group run every forward pass together, idle or not.

Each MoE layer of a forward pass is a collective (`exchange`), so a rank may only enter a pass when
every rank does. The rule that keeps them matched, whatever each rank's scheduler decides:

- every forward pass starts with a *header*: one all_gather of each rank's ``[running, leaving,
  tokens]``. A rank about to run a real pass (a step, or a re-run while containing a fault) sends
  ``running = 1`` and its token count (the exchanges of the pass's MoE layers need every rank's
  count: they read it here, ``token_counts``, instead of gathering it again in every layer);
- a rank whose loop iteration ran no pass calls ``idle_round``: a header with ``running = 0``, and
  if anybody is running, a *dummy pass*: its share of every MoE layer's exchange with zero tokens
  of its own (its experts still serve the others' tokens);
- a pass that raises part way still finishes its MoE layers as dummies (``forward_pass``), so the
  others' collectives complete; the error then goes on to the engine's fault containment, and
  its re-runs are passes like any other. A rank whose experts fail tells the ranks they served
  (`ExpertsFailedError` there: their pass fails and is contained too, never computed without
  those rows); an error in a dummy layer is logged and the remaining layers still run.

Between two headers every rank therefore makes the same collectives. A header with ``leaving``
set (the API process asked a rank to stop) ends every rank's loop after that round. A collective
that fails (a peer died, or gloo's fixed 30 s wait ran out: no rank may spend longer than that
between two collectives while another waits) raises `ParallelGroupError`: the group cannot step
without that rank. ``barrier`` holds the ranks at startup until all have loaded their model, with
the startup timeout, through the group's store; a rank's process ends with every rank
(`fdplug.core.parallel.group_exit`: paddle's store can abort a process that exits alone).

``init_group`` starts paddle.distributed in an engine process from the rank, size and rendezvous
endpoint the API process chose (gloo on the cpu device, the device's own backend elsewhere).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fdplug.core.parallel.exchange import Collectives
from fdplug.core.parallel.group_exit import arrivals_within
from fdplug.errors import ConfigError, ParallelGroupError

logger = logging.getLogger("fdplug.engine")

_GROUP: LockstepGroup | None = None


class LockstepGroup(Collectives):
    """One engine process's view of its expert-parallel group (``rank`` of ``size``); as the
    exchanges' `Collectives`, a failed call is a `ParallelGroupError` and its time is counted."""

    def __init__(self, rank: int, size: int, group: Any = None) -> None:
        super().__init__(group)
        self.rank, self.size = rank, size
        self.shard: Any = None           # this rank's experts (`attach`)
        self.exchange: Any = None        # the MoE layers' `ExpertExchange` (`attach`)
        self.blocks: list[Any] = []      # the model's MoE blocks in forward order (`SparseMoEBlock.expert_round`)
        self.layer: int | None = None    # MoE layers done in the pass under way (None: no pass)
        self.token_counts: list[int] = [0] * size   # each rank's tokens in the pass under way (the header's)
        self.leaving = False             # a rank asked the group to stop
        self.busy = False                # the last header had a pass: don't sleep before the next
        self.headers = 0
        self.passes = self.dummy_passes = 0
        self.pass_seconds = 0.0          # in passes, real and dummy, headers included
        self.exchange_seconds = 0.0      # of which in the MoE layers' dispatch + combine
        self.header_seconds = 0.0        # of which in headers (waiting for the slowest rank mostly)

    def attach(self, backend: Any, num_experts: int) -> None:
        """The model's MoE layers have ``num_experts`` experts run by ``backend``: this rank's share,
        and the exchange (the backend's own, else by capability; a collective probe, every rank)."""
        from fdplug.core.parallel.exchange import ExpertShard, choose_exchange

        try:
            self.shard = ExpertShard(self.rank, self.size, num_experts)
        except ValueError as exc:
            raise ConfigError(f"{exc}.", fix="choose an --expert-parallel-size that divides the number of experts.") \
                from None
        self.exchange = self.collective(lambda: choose_exchange(backend, self.group, self.shard,
                                                                lambda: self.token_counts, comm=self))
        logger.info("%s: experts %d..%d of %d, %s exchange", self.describe(), self.shard.first,
                    self.shard.first + self.shard.count - 1, num_experts, self.exchange.name)

    # -- rounds -----------------------------------------------------------------------------------

    @contextmanager
    def forward_pass(self, tokens: int) -> Iterator[None]:
        """A real pass of this rank over ``tokens`` tokens; its MoE layers are finished as dummies
        if it raises part way."""
        if self.leaving:
            raise ParallelGroupError("the expert-parallel group is stopping.", fix="the server is shutting down.")
        started = time.perf_counter()
        self._header(running=True, leaving=False, tokens=tokens)
        self.passes += 1
        self.layer = 0
        try:
            yield
        except ParallelGroupError:   # the group is broken: no more collectives
            self.layer = None
            raise
        except BaseException:
            self._finish_layers()     # the pass's own error wins over any of the dummies'
            raise
        else:
            self._finish_layers()     # a model with MoE layers finishes them all: a no-op
        finally:
            self.layer = None
            self.pass_seconds += time.perf_counter() - started

    def idle_round(self, leaving: bool = False) -> None:
        """This rank has no pass to run: take part in the round (a dummy pass if anybody runs one)."""
        started = time.perf_counter()
        if self._header(running=False, leaving=leaving):
            self.dummy_passes += 1
            self.layer = 0
            self._finish_layers()
            self.pass_seconds += time.perf_counter() - started

    def moe_layer(self) -> None:
        """Called by each MoE block as it exchanges: one more layer of this pass done."""
        if self.layer is None:
            raise RuntimeError("a MoE layer ran outside a lockstep pass (an engine bug: the model was called "
                               "without LockstepGroup.forward_pass)")
        self.layer += 1

    def _header(self, running: bool, leaving: bool, tokens: int = 0) -> bool:
        import paddle

        flags = paddle.to_tensor([int(running), int(leaving), tokens], dtype="int64")
        gathered: list[Any] = []
        started = time.perf_counter()
        self.collective(lambda: self.dist.all_gather(gathered, flags, group=self.group), timed=False)
        self.header_seconds += time.perf_counter() - started
        rows = [[int(v) for v in rank.numpy()] for rank in gathered]
        runners, leavers = sum(r[0] for r in rows), sum(r[1] for r in rows)
        self.token_counts = [r[2] for r in rows]
        self.headers += 1
        self.busy = runners > 0
        self.leaving = self.leaving or leavers > 0
        return runners > 0

    def _finish_layers(self) -> None:
        """The pass's remaining MoE layers as dummies, every one of them: an error in one (this
        rank's experts failed for the others' tokens, who are told) is logged, not raised."""
        while self.layer is not None and self.layer < len(self.blocks):
            layer = self.layer
            try:
                self.blocks[layer].expert_round(None)
            except ParallelGroupError:
                self.layer = None
                raise
            except Exception as exc:
                if self.layer == layer:   # failed before its exchange: the others would wait for it
                    self.layer = None
                    raise ParallelGroupError(f"{self.describe()}: MoE layer {layer} failed before its exchange in "
                                             f"a dummy round ({type(exc).__name__}: {str(exc)[:200]}).",
                                             fix="report it with the server log (an engine bug).") from exc
                logger.exception("%s: MoE layer %d failed in a dummy round (the ranks it served fail their pass)",
                                 self.describe(), layer)
        self.layer = None

    def run(self, call: Any) -> Any:
        """`Collectives`' hook: every exchange collective goes through ``collective``."""
        return self.collective(call)

    def collective(self, call: Any, timed: bool = True) -> Any:
        """Run one collective call (``timed``: an exchange's, counted in ``exchange_seconds``); a
        failure (a peer gone) is the group's: `ParallelGroupError`."""
        started = time.perf_counter()
        try:
            return call()
        except Exception as exc:
            raise ParallelGroupError(f"a collective of the expert-parallel group failed on rank {self.rank} "
                                     f"({type(exc).__name__}: {str(exc)[:200]}).",
                                     fix="a peer engine stopped; restart the server (the group runs as one).") from exc
        finally:
            if timed:
                self.exchange_seconds += time.perf_counter() - started

    def barrier(self, timeout: float, name: str = "loaded") -> None:
        """Wait, at most ``timeout`` seconds, until every rank got here (through the group's store,
        not a collective: gloo's waits end after 30 s, and ranks load big models at their own pace)."""
        from paddle.base import core

        store, key = core.create_or_get_global_tcp_store(), f"fdplug/{name}"
        store.add(key, 1)
        if (arrived := arrivals_within(store, key, self.size, timeout)) < self.size:
            raise ParallelGroupError(f"{self.describe()}: only {arrived} of {self.size} ranks were ready within "
                                     f"{timeout:.0f} s.", fix="see the other engines' messages for why; set "
                                     "FDPLUG_ENGINE_STARTUP_TIMEOUT higher for a large model.")

    def describe(self) -> str:
        return f"expert parallel rank {self.rank} of {self.size}"

    def summary(self) -> str:
        """What the group cost this rank (logged at exit; bench/scale.py --ep reads it)."""
        share = self.exchange_seconds / self.pass_seconds if self.pass_seconds else 0.0
        return (f"{self.describe()}: {self.passes} passes of its own, {self.dummy_passes} dummy; "
                f"{self.pass_seconds:.3f} s in passes, exchange {self.exchange_seconds:.3f} s ({share:.1%}), "
                f"headers {self.header_seconds:.3f} s")


def init_group(rank: int, size: int, endpoints: list[str], device: str, device_index: int = 0) -> LockstepGroup:
    """Start paddle.distributed for rank ``rank`` of ``size`` (``endpoints``: each rank's host:port,
    the first one rank 0's store, the rendezvous) and make it this process's group: gloo on the
    cpu device, else paddle's choice for its build (NCCL, BKCL) on device ``device_index``."""
    global _GROUP
    if size < 2 or not 0 <= rank < size or len(endpoints) != size:
        raise ConfigError(f"expert-parallel rank {rank} of {size} with {len(endpoints)} endpoints is not a group.",
                          fix="--expert-parallel-size must be at least 2.")
    host, _, port = endpoints[0].rpartition(":")
    os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(size), MASTER_ADDR=host,
                      MASTER_PORT=port, PADDLE_TRAINER_ENDPOINTS=",".join(endpoints),
                      PADDLE_CURRENT_ENDPOINT=endpoints[rank],
                      PADDLE_DISTRI_BACKEND="gloo" if device == "cpu" else "auto")
    if device in ("cuda", "gpu"):
        os.environ["FLAGS_selected_gpus"] = str(device_index)
    elif device == "xpu":
        os.environ["FLAGS_selected_xpus"] = str(device_index)
    import paddle.distributed as dist

    started = time.perf_counter()
    dist.init_parallel_env()
    _GROUP = LockstepGroup(rank, size)
    logger.info("%s joined the group at %s in %.1f s (%s)", _GROUP.describe(), endpoints[0],
                time.perf_counter() - started,
                os.environ["PADDLE_DISTRI_BACKEND"])
    return _GROUP


def current_group() -> LockstepGroup | None:
    """This process's expert-parallel group (None: it runs alone)."""
    return _GROUP
