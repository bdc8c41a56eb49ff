"""An engine's side of prefill/decode disaggregation: what its scheduler does with remote KV.

``EngineConfig.kv_role`` = ``prefill``: a request with ``kv_transfer_params={"do_remote_decode":
True}`` that finishes normally (it ran with ``max_tokens=1``) keeps its full prompt blocks (a
reference held in the block pool) and offers them (`pull.KVSender`); its last output carries
``kv_transfer_params``: where to pull, the transfer id, its first token. The blocks are released
when the pull is served or after ``FDPLUG_KV_PICKUP_TIMEOUT``.

``decode``: a request arriving with those params (``conn``, ``first_token``) starts with the first
token already generated and waits (``WAITING_FOR_REMOTE_KV``, skipped by the scheduler) while this
side allocates blocks for the prompt's full blocks (a local prefix hit is not pulled again) and
pulls them (`pull.KVReceiver`). Landed blocks enter the prefix cache and are released; the request
then waits like any other and its first step is a prefix hit: only the prompt's last partial block
and the first token are computed here. A pull that fails, or does not land within
``FDPLUG_KV_TRANSFER_TIMEOUT`` of the request's arrival, fails the request (typed, 502/504).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fdplug.core.engine.request import Request, RequestStatus
from fdplug.core.kv_transfer.pull import KVReceiver, KVSender
from fdplug.core.scheduler.output import EngineCoreOutput
from fdplug.core.scheduler.request_rules import check_stop
from fdplug.errors import (
    ConfigError,
    InvalidRequestError,
    KVTransferError,
    KVTransferTimeoutError,
    error_to_dict,
)
from fdplug.plugin_api.kv_layout import layout_of

ROLES = ("prefill", "decode")


def runner_caches(runner: Any) -> tuple[list[tuple[Any, Any]], str]:
    """The runner's KV caches and their layout, or a ConfigError saying why they cannot move."""
    caches, backend = getattr(runner, "kv_caches", None), getattr(runner, "attn_backend", None)
    layout = layout_of(backend) if backend is not None else None
    if not caches or layout is None:
        raise ConfigError("prefill/decode disaggregation needs the runner's KV caches in a known layout "
                          f"(runner {type(runner).__name__}, attention {getattr(backend, 'name', None)!r}).",
                          fix="use the core's runner and an attention backend that declares kv_cache_layout.")
    return caches, layout


class PrefillSide:
    """Holds and offers the prompt blocks of requests that a decode instance continues."""

    def __init__(self, runner: Any, scheduler: Any, pickup_timeout: float, address: str = "tcp://127.0.0.1:0"):
        caches, layout = runner_caches(runner)
        self.sender = KVSender(caches, layout, address, pickup_timeout)
        self.scheduler, self.block_size = scheduler, scheduler.config.block_size
        self.held: dict[str, list[Any]] = {}        # transfer id -> the blocks it holds a reference to
        self.params: dict[str, dict] = {}           # request id -> its kv_transfer_params, for its last output
        scheduler.on_free = self.on_free

    def on_free(self, request: Request, blocks: list[Any]) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or request.status not in (
                RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) or not request.output_token_ids:
            return
        full = blocks[:request.num_prompt_tokens // self.block_size]
        out = {"first_token": request.output_token_ids[0], "num_prompt_tokens": request.num_prompt_tokens,
               "block_size": self.block_size}
        if full:
            self.scheduler.kv_cache_manager.block_pool.touch(full)
            out["conn"] = self.sender.offer([b.block_id for b in full])
            self.held[out["conn"]["transfer_id"]] = full
        self.params[request.request_id] = out

    @property
    def busy(self) -> bool:
        return bool(self.held)

    def admit(self, request: Request) -> bool:
        """Every request is queued as it comes (only a decode side starts one with remote KV)."""
        return True

    def poll(self) -> list[EngineCoreOutput]:
        """Serve the pulls that arrived; release the blocks of what was pulled or expired."""
        sent, expired = self.sender.poll()
        for transfer_id in sent | expired:
            self.scheduler.kv_cache_manager.block_pool.free_blocks(self.held.pop(transfer_id, []))
        return []

    def finished(self, outputs: list[EngineCoreOutput]) -> None:
        """A step's outputs: the last one of an offered request carries its params."""
        for out in outputs:
            if out.finished and out.request_id in self.params:
                out.kv_transfer_params = self.params.pop(out.request_id)

    def cancel(self, request_id: str) -> None:
        self.params.pop(request_id, None)

    def close(self) -> None:
        self.sender.close()


@dataclass(slots=True)
class _Incoming:
    request: Request
    deadline: float
    num_full: int
    transfer_id: str | None = None


class DecodeSide:
    """Pulls the prompt KV of requests a prefill instance started."""

    def __init__(self, runner: Any, scheduler: Any, transfer_timeout: float, stall_timeout: float):
        caches, layout = runner_caches(runner)
        self.receiver = KVReceiver(caches, layout, stall_timeout)
        self.scheduler, self.block_size, self.timeout = scheduler, scheduler.config.block_size, transfer_timeout
        self.incoming: dict[str, _Incoming] = {}
        self.ready: list[EngineCoreOutput] = []

    def admit(self, request: Request) -> bool:
        """Before the scheduler queues it: check the params, add the first token, wait for the KV.
        False: the first token already ended it (its output is ready; nothing to queue)."""
        params = request.kv_transfer_params
        if not params or "first_token" not in params:
            return True
        if request.mm_inputs:   # the decode side would compute (and fetch features for) the prompt's tail
            raise InvalidRequestError("kv_transfer_params came with multimodal items: PD does not serve those yet.",
                                      fix="send multimodal requests to an instance without --role.",
                                      param="kv_transfer_params")
        first, conn = params.get("first_token"), params.get("conn")
        if not isinstance(first, int) or isinstance(first, bool) or params.get("block_size") != self.block_size \
                or params.get("num_prompt_tokens") != request.num_prompt_tokens \
                or (conn is not None and not (isinstance(conn, dict) and isinstance(conn.get("transfer_id"), str)
                                              and isinstance(conn.get("addr"), str))):
            raise InvalidRequestError("kv_transfer_params do not describe this prompt on this instance (first token, "
                                      "prompt length, block size or conn).",
                                      fix="pass the kv_transfer_params the prefill instance returned, unchanged.",
                                      param="kv_transfer_params")
        request.append_output_token(first)
        if check_stop(request, self.scheduler.config.max_model_len):
            self.ready.append(EngineCoreOutput(request.request_id, [first], finished=True,
                                               finish_reason=request.status.finish_reason,
                                               stop_reason=request.stop_reason))
            return False
        self.ready.append(EngineCoreOutput(request.request_id, [first]))
        num_full = request.num_prompt_tokens // self.block_size if conn is not None else 0
        if num_full:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KV
            self.incoming[request.request_id] = _Incoming(request, time.monotonic() + self.timeout, num_full)
        return True

    @property
    def busy(self) -> bool:
        return bool(self.ready)

    def finished(self, outputs: list[EngineCoreOutput]) -> None:
        pass

    def cancel(self, request_id: str) -> None:
        item = self.incoming.pop(request_id, None)
        if item is not None and item.transfer_id is not None:
            self.receiver.cancel(item.transfer_id)

    def poll(self) -> list[EngineCoreOutput]:
        """Start pulls that have blocks now, land what arrived; the outputs this makes (first tokens,
        failures). Before the step's schedule: a first token goes out before the second."""
        made, self.ready = self.ready, []
        now = time.monotonic()
        for rid, item in list(self.incoming.items()):
            if item.transfer_id is None and not self._start(item) and now > item.deadline:
                made.append(self._fail(rid, "no KV blocks were free for the transfer in time", timeout=True))
        done, failed = self.receiver.poll()
        by_transfer = {item.transfer_id: rid for rid, item in self.incoming.items() if item.transfer_id}
        for transfer_id in done:
            self._landed(self.incoming[by_transfer[transfer_id]])
        for transfer_id, why in failed.items():
            made.append(self._fail(by_transfer[transfer_id], why))
        for rid, item in list(self.incoming.items()):
            if item.transfer_id is not None and now > item.deadline:
                made.append(self._fail(rid, f"the KV did not arrive within {self.timeout:g} s", timeout=True))
        return made

    def _start(self, item: _Incoming) -> bool:
        """Allocate the blocks the prompt's full blocks need here (a local hit is not pulled) and
        start the pull; False: no room yet."""
        kv = self.scheduler.kv_cache_manager
        hit_blocks, num_hit = kv.get_computed_blocks(item.request)
        first = min(num_hit // self.block_size, item.num_full)
        if first == item.num_full:          # all of it is cached here already: the prefill side may let go
            self.receiver.release(item.request.kv_transfer_params["conn"])
            self._landed(item)
            return True
        if kv.allocate_slots(item.request, (item.num_full - first) * self.block_size, hit_blocks[:first]) is None:
            return False
        block_ids = kv.get_block_ids(item.request.request_id)[first:item.num_full]
        item.transfer_id = self.receiver.pull(item.request.kv_transfer_params["conn"], block_ids, first)
        return True

    def _landed(self, item: _Incoming) -> None:
        """The prompt's full blocks hold its KV: cache them, release them, let the scheduler take it
        (its first step is a prefix hit on them)."""
        kv = self.scheduler.kv_cache_manager
        self.incoming.pop(item.request.request_id, None)
        if item.transfer_id:
            kv.cache_blocks(item.request, item.num_full * self.block_size)
            kv.free(item.request)
        item.request.status = RequestStatus.WAITING

    def _fail(self, request_id: str, why: str, timeout: bool = False) -> EngineCoreOutput:
        self.cancel(request_id)
        error = (KVTransferTimeoutError if timeout else KVTransferError)(
            f"the prompt's KV could not be pulled from the prefill instance: {why}.",
            fix="retry the request; check that the prefill instance is running and reachable.")
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(request_id, [], finished=True, finish_reason="error", error=error_to_dict(error))

    def close(self) -> None:
        self.receiver.close()


def make_side(config: Any, runner: Any, scheduler: Any) -> PrefillSide | DecodeSide | None:
    """This engine's side of PD disaggregation (``config.kv_role``), None when it does both."""
    from fdplug.core.settings import env

    if config.kv_role == "prefill":
        host = env("FDPLUG_KV_HOST") or "127.0.0.1"
        return PrefillSide(runner, scheduler, env("FDPLUG_KV_PICKUP_TIMEOUT"), f"tcp://{host}:0")
    if config.kv_role == "decode":
        return DecodeSide(runner, scheduler, env("FDPLUG_KV_TRANSFER_TIMEOUT"), env("FDPLUG_KV_STALL_TIMEOUT"))
    return None
