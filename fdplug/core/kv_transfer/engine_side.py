"""An engine's side of prefill/decode disaggregation: what its scheduler does with remote KV.

The core decides which blocks hold a request's KV on each side and owns every deadline; the
selected KV connector (`fdplug.plugin_api.kv_connector`) only moves the bytes.

``EngineConfig.kv_role`` = ``prefill``: a request with ``kv_transfer_params={"do_remote_decode":
True}`` that finishes normally (it ran with ``max_tokens=1``) keeps the blocks of its whole prompt
(a reference held in the block pool) and the connector offers them; its last output carries
``kv_transfer_params`` (`params`): where to pull, its first token, what it is a prompt of. The
blocks are let go when the pull is served or after ``FDPLUG_KV_PICKUP_TIMEOUT``.

``decode``: a request arriving with those params starts with the first token already generated
and waits (``WAITING_FOR_REMOTE_KV``, skipped by the scheduler) until blocks for its whole prompt
are free here (a local prefix hit is not pulled again), then until the connector lands the rest
in them. It then holds those blocks with its whole prompt computed: its first step computes only
the first token, so a decode instance never needs a multimodal item's features. A pull that
fails, or does not land within ``FDPLUG_KV_TRANSFER_TIMEOUT`` of the request's arrival, fails the
request alone (typed, 502/504) and frees its blocks at once.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any

from fdplug.core.engine.request import Request, RequestStatus
from fdplug.core.kv_transfer.params import check_params, make_params
from fdplug.core.scheduler.output import EngineCoreOutput
from fdplug.core.scheduler.request_rules import check_stop
from fdplug.errors import (
    ConfigError,
    KVTransferError,
    KVTransferTimeoutError,
    error_to_dict,
)
from fdplug.plugin_api.attention import cdiv
from fdplug.plugin_api.kv_connector import KVCaches
from fdplug.plugin_api.kv_layout import layout_of

logger = logging.getLogger("fdplug.kv_transfer")


def runner_caches(runner: Any, host: str, stall_timeout: float) -> KVCaches:
    """The runner's KV caches for a connector, or a ConfigError saying why they cannot move."""
    caches, backend = getattr(runner, "kv_caches", None), getattr(runner, "attn_backend", None)
    layout = layout_of(backend) if backend is not None else None
    if not caches or layout is None:
        raise ConfigError("prefill/decode disaggregation needs the runner's KV caches in a known layout "
                          f"(runner {type(runner).__name__}, attention {getattr(backend, 'name', None)!r}).",
                          fix="use the core's runner and an attention backend that declares kv_cache_layout.")
    block_size = int(caches[0][0].shape[layout.index("T")])
    return KVCaches(caches, layout, block_size, host, stall_timeout)


class PrefillSide:
    """Holds and offers the prompt blocks of requests that a decode instance continues."""

    def __init__(self, sender: Any, scheduler: Any, pickup_timeout: float, secret: str | None = None):
        self.sender, self.scheduler, self.pickup_timeout, self.secret = sender, scheduler, pickup_timeout, secret
        self.block_size = scheduler.config.block_size
        self.held: dict[str, tuple[list[Any], float]] = {}   # transfer id -> (the blocks it holds, deadline)
        self.params: dict[str, dict] = {}           # request id -> its kv_transfer_params, for its last output
        scheduler.on_free = self.on_free

    def on_free(self, request: Request, blocks: list[Any]) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or request.status not in (
                RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) or not request.output_token_ids:
            return
        prompt = blocks[:cdiv(request.num_prompt_tokens, self.block_size)]
        try:
            conn = self.sender.offer([b.block_id for b in prompt])
        except Exception:       # a connector's bug: this request's answer says so (no params), nothing is held
            logger.exception("the KV connector could not offer request %s's blocks", request.request_id)
            return
        self.scheduler.kv_cache_manager.block_pool.touch(prompt)
        self.held[conn["transfer_id"]] = (prompt, time.monotonic() + self.pickup_timeout)
        self.params[request.request_id] = make_params(request, self.sender.name, self.block_size, conn, self.secret)

    @property
    def busy(self) -> bool:
        return bool(self.held)

    def admit(self, request: Request) -> bool:
        """Every request is queued as it comes (only a decode side starts one with remote KV)."""
        return True

    def poll(self) -> list[EngineCoreOutput]:
        """Serve the pulls that arrived; free the blocks of what was pulled, released or not
        picked up in time (the connector is told first: it never reads them again)."""
        try:
            done = self.sender.poll()
        except Exception:           # a broken connector: its offers expire, the engine goes on
            logger.exception("the KV connector's poll failed")
            done = set()
        now = time.monotonic()
        for transfer_id, (_, deadline) in list(self.held.items()):
            if deadline <= now and transfer_id not in done:
                self.sender.withdraw(transfer_id)
                done.add(transfer_id)
        for transfer_id in done:
            blocks, _ = self.held.pop(transfer_id, ([], 0.0))
            self.scheduler.kv_cache_manager.block_pool.free_blocks(blocks)
        return []

    def finished(self, outputs: list[EngineCoreOutput]) -> None:
        """A step's outputs: the last one of an offered request carries its params (and the first
        token's logprobs, when it asked for them: the decode side reports them)."""
        for out in outputs:
            if out.finished and out.request_id in self.params:
                out.kv_transfer_params = self.params.pop(out.request_id)
                if out.new_logprobs:
                    out.kv_transfer_params["first_logprobs"] = [list(part) for part in out.new_logprobs[-1]]

    def cancel(self, request_id: str) -> None:
        self.params.pop(request_id, None)

    def close(self) -> None:
        self.sender.close()


@dataclass(slots=True)
class _Incoming:
    request: Request
    deadline: float
    pulling: bool = False


class DecodeSide:
    """Pulls the prompt KV of requests a prefill instance started."""

    def __init__(self, receiver: Any, scheduler: Any, transfer_timeout: float, vocab_size: int,
                 secret: str | None = None):
        self.receiver, self.scheduler, self.timeout, self.secret = receiver, scheduler, transfer_timeout, secret
        self.vocab_size = vocab_size
        self.block_size = scheduler.config.block_size
        self.incoming: dict[str, _Incoming] = {}
        self.landed: list[Request] = []            # holding their blocks, waiting for the scheduler
        self.ready: list[EngineCoreOutput] = []

    def admit(self, request: Request) -> bool:
        """Before the scheduler queues it: check the params, add the first token, wait for the KV.
        False: the first token already ended it (its output is ready; nothing to queue)."""
        params = request.kv_transfer_params
        if not params:
            return True
        check_params(params, request, self.receiver.name, self.block_size, self.secret, self.vocab_size)
        if self.secret is None:     # unsigned: this request's blocks are its own, never another's prefix
            request.cache_salt = f"{request.cache_salt or ''}|pd-unverified-{secrets.token_hex(16)}"
        request.mm_positions = [replace(p, mm_hash=h) for p, h in zip(request.mm_positions, params["mm_hashes"])]
        request.num_cached_tokens = params["num_cached_tokens"]     # the prefill side's hit: what usage reports
        first = params["first_token"]
        logprobs = [tuple(params["first_logprobs"])] if request.sampling_params.logprobs is not None else None
        request.append_output_token(first)
        if check_stop(request, self.scheduler.config.max_model_len):
            self.ready.append(EngineCoreOutput(request.request_id, [first], True, request.status.finish_reason,
                                               request.stop_reason, request.num_cached_tokens, logprobs))
            return False
        self.ready.append(EngineCoreOutput(request.request_id, [first], new_logprobs=logprobs))
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.incoming[request.request_id] = _Incoming(request, time.monotonic() + self.timeout)
        return True

    @property
    def busy(self) -> bool:
        return bool(self.ready)

    def finished(self, outputs: list[EngineCoreOutput]) -> None:
        pass

    def cancel(self, request_id: str) -> None:
        item = self.incoming.pop(request_id, None)
        if item is not None and item.pulling:
            self.receiver.cancel(item.request.kv_transfer_params["conn"]["transfer_id"])

    def poll(self) -> list[EngineCoreOutput]:
        """Start pulls that have blocks now, land what arrived; the outputs this makes (first tokens,
        failures). Before the step's schedule: a first token goes out before the second."""
        made, self.ready = self.ready, []
        now = time.monotonic()
        for rid, item in list(self.incoming.items()):
            if not item.pulling and not self._start(item, made) and now > item.deadline:
                made.append(self._fail(rid, "no KV blocks were free for the transfer in time", timeout=True))
        by_transfer = {item.request.kv_transfer_params["conn"]["transfer_id"]: rid
                       for rid, item in self.incoming.items() if item.pulling}
        try:
            landed, failed = self.receiver.poll()
        except Exception as exc:    # a broken connector fails its transfers, not the engine
            logger.exception("the KV connector's poll failed")
            landed, failed = set(), dict.fromkeys(by_transfer, f"the connector failed ({type(exc).__name__})")
        for transfer_id in landed & by_transfer.keys():
            self._landed(self.incoming[by_transfer[transfer_id]])
        for transfer_id, why in failed.items():
            if transfer_id in by_transfer:
                made.append(self._fail(by_transfer[transfer_id], why))
        for rid, item in list(self.incoming.items()):
            if item.pulling and now > item.deadline:
                made.append(self._fail(rid, f"the KV did not arrive within {self.timeout:g} s", timeout=True))
        self._landed_first()
        return made

    def _landed_first(self) -> None:
        """Requests that hold their pulled blocks go to the front of the waiting queue: each needs a
        slot, not a prompt's worth of blocks, and behind a request that cannot get its blocks (a
        preempted one) they would keep theirs from it for good."""
        self.landed = [r for r in self.landed if r.status == RequestStatus.WAITING
                       and r.request_id in self.scheduler.requests]
        waiting = self.scheduler.waiting
        if self.landed and list(waiting)[:len(self.landed)] != self.landed:
            ids = {r.request_id for r in self.landed}
            rest = [r for r in waiting if r.request_id not in ids]
            waiting.clear()
            waiting.extend(self.landed + rest)

    def _start(self, item: _Incoming, made: list[EngineCoreOutput]) -> bool:
        """Allocate blocks for the whole prompt (a local hit is not pulled) and start pulling the
        rest; False: no room yet."""
        request, kv = item.request, self.scheduler.kv_cache_manager
        conn = request.kv_transfer_params["conn"]
        hit_blocks, num_hit = kv.get_computed_blocks(request)
        first, total = num_hit // self.block_size, cdiv(request.num_prompt_tokens, self.block_size)
        if first < total and kv.allocate_slots(request, request.num_prompt_tokens - num_hit, hit_blocks) is None:
            return False
        try:
            if first == total:      # all of it is cached here: the prefill side may let go
                self.receiver.release(conn)
            else:
                self.receiver.pull(conn, kv.get_block_ids(request.request_id)[first:total], first)
        except Exception as exc:  # noqa: BLE001 -- a conn this connector cannot use (or its bug): this request fails
            made.append(self._fail(request.request_id, f"the connector refused it ({type(exc).__name__}: {exc})"))
            return True
        if first == total:
            del self.incoming[request.request_id]
            request.status = RequestStatus.WAITING
        item.pulling = first < total
        return True

    def _landed(self, item: _Incoming) -> None:
        """The prompt's blocks hold its KV: its full blocks enter the prefix cache, the request
        keeps them all, its whole prompt computed; the scheduler takes it from there."""
        request, kv = item.request, self.scheduler.kv_cache_manager
        del self.incoming[request.request_id]
        kv.cache_blocks(request, request.num_prompt_tokens // self.block_size * self.block_size)
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.WAITING
        self.landed.append(request)

    def _fail(self, request_id: str, why: str, timeout: bool = False) -> EngineCoreOutput:
        self.cancel(request_id)
        error = (KVTransferTimeoutError if timeout else KVTransferError)(
            f"the prompt's KV could not be pulled from the prefill instance: {why}.",
            fix="retry the request; check that the prefill instance is running and reachable.")
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(request_id, [], finished=True, finish_reason="error", error=error_to_dict(error))

    def close(self) -> None:
        self.receiver.close()


def make_side(config: Any, selection: Any, runner: Any, scheduler: Any,
              vocab_size: int) -> PrefillSide | DecodeSide | None:
    """This engine's side of PD disaggregation (``config.kv_role``) over the selected connector;
    None when it does both."""
    from fdplug.core.settings import env

    if config.kv_role is None:
        return None
    caches = runner_caches(runner, env("FDPLUG_KV_HOST") or "127.0.0.1", env("FDPLUG_KV_STALL_TIMEOUT"))
    connector = selection.kv_connector.factory(config, config.kv_role, caches)
    if config.kv_role == "prefill":
        return PrefillSide(connector, scheduler, env("FDPLUG_KV_PICKUP_TIMEOUT"), env("FDPLUG_PD_SECRET"))
    return DecodeSide(connector, scheduler, env("FDPLUG_KV_TRANSFER_TIMEOUT"), vocab_size, env("FDPLUG_PD_SECRET"))
