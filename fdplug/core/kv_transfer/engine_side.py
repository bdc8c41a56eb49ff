"""An engine's side of prefill/decode disaggregation: what its scheduler does with remote KV.

The core decides which blocks hold a request's KV on each side and owns every deadline; the
selected KV connector (`fdplug.plugin_api.kv_connector`) only moves the bytes.

``EngineConfig.kv_role`` = ``prefill``: a request with ``kv_transfer_params={"do_remote_decode":
True}`` that finishes normally (it ran with ``max_tokens=1``) keeps the blocks of its whole prompt
(a reference held in the block pool) and the connector offers them; its last output carries
``kv_transfer_params`` (`params`): where to pull, its first token, what it is a prompt of. The
blocks are let go when the pull is served or after ``FDPLUG_KV_PICKUP_TIMEOUT``.

``decode``: a request arriving with those params waits for its prompt's KV and continues from
the first token (`fdplug.core.kv_transfer.decode_side`).

The params' ``conn`` is the client's to write, so a decode side trusts its address only when the
params are signed (``FDPLUG_PD_SECRET``) or it names a prefill instance of ``--kv-peers``
(`fdplug.core.kv_transfer.peers`): the receiver's ``check`` refuses any other conn as the request
is admitted (a 400, before any socket), and an instance with neither does not start.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fdplug.core.kv_transfer.decode_side import DecodeSide
from fdplug.core.kv_transfer.params import make_params
from fdplug.core.kv_transfer.peers import check_decode_trust, resolve_peers
from fdplug.core.request import Request, RequestStatus
from fdplug.core.scheduler.output import EngineCoreOutput
from fdplug.core.scheduler.step_extension import StepExtension
from fdplug.errors import ConfigError
from fdplug.plugin_api.attention import cdiv
from fdplug.plugin_api.kv_connector import KVCaches, KVConnChecker
from fdplug.plugin_api.kv_layout import layout_of

logger = logging.getLogger("fdplug.kv_transfer")


def runner_caches(runner: Any, host: str, stall_timeout: float, port: int = 0,
                  peers: frozenset[tuple[str, int]] | None = None) -> KVCaches:
    """The runner's KV caches for a connector, or a ConfigError saying why they cannot move."""
    caches, backend = getattr(runner, "kv_caches", None), getattr(runner, "attn_backend", None)
    layout = layout_of(backend) if backend is not None else None
    if not caches or layout is None:
        raise ConfigError("prefill/decode disaggregation needs the runner's KV caches in a known layout "
                          f"(runner {type(runner).__name__}, attention {getattr(backend, 'name', None)!r}).",
                          fix="use the core's runner and an attention backend that declares kv_cache_layout.")
    block_size = int(caches[0][0].shape[layout.index("T")])
    return KVCaches(caches, layout, block_size, host, stall_timeout, port, peers)


class PrefillSide(StepExtension):
    """Holds and offers the prompt blocks of requests that a decode instance continues."""

    def __init__(self, sender: Any, scheduler: Any, pickup_timeout: float, secret: str | None = None):
        self.sender, self.scheduler, self.pickup_timeout, self.secret = sender, scheduler, pickup_timeout, secret
        self.block_size = scheduler.config.block_size
        self.held: dict[str, tuple[list[Any], float]] = {}   # transfer id -> (the blocks it holds, deadline)
        self.params: dict[str, dict] = {}           # request id -> its kv_transfer_params, for its last output

    name = "pd-prefill"

    def on_free(self, request: Request, blocks: list[Any]) -> None:
        """A finished request a decode instance continues: offer its prompt's blocks (and keep them)."""
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

    def close(self) -> None:
        self.sender.close()




def make_side(config: Any, selection: Any, runner: Any, scheduler: Any,
              vocab_size: int) -> PrefillSide | DecodeSide | None:
    """This engine's side of PD disaggregation (``config.kv_role``) over the selected connector;
    None when it does both."""
    from fdplug.core.settings import env

    if config.kv_role is None:
        return None
    secret = env("FDPLUG_PD_SECRET")
    check_decode_trust(config, secret)
    decode = config.kv_role == "decode"
    peers = resolve_peers(config.kv_peers) if decode and config.kv_peers else None
    caches = runner_caches(runner, env("FDPLUG_KV_HOST") or "127.0.0.1", env("FDPLUG_KV_STALL_TIMEOUT"),
                           0 if decode else config.kv_port or 0, peers)
    connector = selection.kv_connector.factory(config, config.kv_role, caches)
    if not decode:
        address = getattr(connector, "address", None)
        logger.info("PD prefill: decode instances pull KV from %s (%s connector): name it in their --kv-peers, "
                    "or share FDPLUG_PD_SECRET with them", str(address).removeprefix("tcp://") if address
                    else "where the connector says", connector.name)
        return PrefillSide(connector, scheduler, env("FDPLUG_KV_PICKUP_TIMEOUT"), secret)
    try:
        _check_receiver(connector, selection.kv_connector.name, peers, secret)
    except ConfigError:
        connector.close()
        raise
    return DecodeSide(connector, scheduler, env("FDPLUG_KV_TRANSFER_TIMEOUT"), vocab_size, secret)


def _check_receiver(receiver: Any, name: str, peers: frozenset[tuple[str, int]] | None, secret: str | None) -> None:
    """A receiver that cannot hold a conn to ``peers`` (no ``check``, or one built without the
    peers it was given) runs only where every params it sees is signed."""
    if isinstance(receiver, KVConnChecker) and getattr(receiver, "peers", peers) == peers:
        return
    why = ("has no check(conn)" if not isinstance(receiver, KVConnChecker)
           else "was built without the --kv-peers it was given (its factory does not pass caches.peers on)")
    if secret is None:
        raise ConfigError(f"the {name!r} KV connector's receiver {why}: without FDPLUG_PD_SECRET this decode instance "
                          "could not keep a client's kv_transfer_params from aiming it at any address.",
                          fix="set the same FDPLUG_PD_SECRET on prefill and decode, or use a KV connector whose "
                              "receiver checks conns (the built-in shm and tcp do).")
    if peers is not None:
        logger.warning("the %r KV connector's receiver %s: --kv-peers is not enforced (params are signed)", name, why)
