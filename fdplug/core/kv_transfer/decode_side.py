"""The decode role's side of prefill/decode disaggregation: `DecodeSide`, which
`fdplug.core.kv_transfer.engine_side` builds (``make_side``) beside the prefill side.

A file of its own because it is the half with a life cycle: it admits a request with params
(checked, its conn included), keeps it waiting for blocks, pulls into them, puts the landed request
at the front of the scheduler's queue, and fails it alone when the pull fails or is late.

A request arriving with the ``kv_transfer_params`` of a prefill instance starts with the first
token already generated and waits (``WAITING_FOR_REMOTE_KV``, skipped by the scheduler) until
blocks for its whole prompt are free here (a local prefix hit is not pulled again), then until the
connector lands the rest in them. It then holds those blocks with its whole prompt computed: its
first step computes only the first token, so a decode instance never needs a multimodal item's
features. A pull that fails, or does not land within ``FDPLUG_KV_TRANSFER_TIMEOUT`` of the
request's arrival, fails the request alone (typed, 502/504) and frees its blocks at once.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any

from fdplug.core.kv_transfer.params import bad, check_params
from fdplug.core.request import Request, RequestStatus
from fdplug.core.scheduler.output import EngineCoreOutput
from fdplug.core.scheduler.request_rules import check_stop
from fdplug.core.scheduler.step_extension import StepExtension
from fdplug.errors import KVTransferError, KVTransferTimeoutError, error_to_dict
from fdplug.plugin_api.attention import cdiv
from fdplug.plugin_api.kv_connector import KVConnChecker

logger = logging.getLogger("fdplug.kv_transfer")


@dataclass(slots=True)
class _Incoming:
    request: Request
    deadline: float
    pulling: bool = False


class DecodeSide(StepExtension):
    """Pulls the prompt KV of requests a prefill instance started."""

    name = "pd-decode"

    def __init__(self, receiver: Any, scheduler: Any, transfer_timeout: float, vocab_size: int,
                 secret: str | None = None):
        self.receiver, self.scheduler, self.timeout, self.secret = receiver, scheduler, transfer_timeout, secret
        self.vocab_size = vocab_size
        self.block_size = scheduler.config.block_size
        self.incoming: dict[str, _Incoming] = {}
        self.landed: list[Request] = []            # holding their blocks, waiting for the scheduler
        self.ready: list[EngineCoreOutput] = []
        # a receiver without ``check`` runs only where the params are signed (`make_side`): decided once
        self.check_conn = receiver.check if isinstance(receiver, KVConnChecker) else None

    def admit(self, request: Request) -> bool:
        """Before the scheduler queues it: check the params, add the first token, wait for the KV.
        False: the first token already ended it (its output is ready; nothing to queue)."""
        params = request.kv_transfer_params
        if not params:
            return True
        check_params(params, request, self.receiver.name, self.block_size, self.secret, self.vocab_size)
        self._check_conn(params["conn"])
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

    def _check_conn(self, conn: dict) -> None:
        """A 400 unless the receiver would pull ``conn``: its own form, an address it may reach
        (``--kv-peers``), no I/O yet."""
        if self.check_conn is None:
            return
        try:
            self.check_conn(conn)
        except (ValueError, TypeError) as exc:
            bad(f"have a conn this decode instance will not pull from ({exc})",
                fix="pass the kv_transfer_params the prefill instance returned, unchanged; a prefill instance this "
                    "decode instance may pull from is named in its --kv-peers (or both share FDPLUG_PD_SECRET).")

    @property
    def busy(self) -> bool:
        return bool(self.ready)

    def on_free(self, request: Request, blocks: list[Any]) -> None:
        """A request leaves (finished, aborted, or refused after `admit`): a pull still under way for
        it is cancelled, and an output not yet polled for it is dropped."""
        self.cancel(request.request_id)
        self.ready = [out for out in self.ready if out.request_id != request.request_id]

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
