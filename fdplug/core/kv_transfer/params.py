"""``kv_transfer_params``: what a prefill instance hands a decode instance, and the checks on it.

A prefill instance returns, with a request's first token::

    {"connector": "shm", "first_token": 271, "num_prompt_tokens": 37, "num_cached_tokens": 16, "block_size": 16,
     "prompt_digest": "<sha256>", "mm_hashes": ["<item identity>", ...], "conn": {...}, "sig": "<hmac>"}

``conn`` is the connector's (where and what to pull); ``num_cached_tokens`` the prefill side's
prefix hit (what the decode side reports in usage); ``prompt_digest`` binds the params to one
prompt (its token ids, cache salt and multimodal placeholders), so a decode instance refuses them
for any other; ``mm_hashes`` are the items' identities, which a decode instance cannot compute (it
never fetches features) and which key its prefix cache. ``sig`` (with ``FDPLUG_PD_SECRET`` set on
the prefill side) is an HMAC-SHA256 over the rest: a decode instance that has the secret refuses
params without a valid one. One without the secret must name the prefill instances it pulls
from (``--kv-peers``, `fdplug.core.kv_transfer.peers`): its connector's ``check`` refuses a
``conn`` aimed anywhere else, and it keeps the request's KV apart from every other request's (a
random cache salt): params a client forged can then only feed that client's own request, never
poison the prefix cache others hit.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any

import msgpack

from fdplug.core.request import Request
from fdplug.errors import InvalidRequestError

KEYS = ("connector", "first_token", "num_prompt_tokens", "num_cached_tokens", "block_size", "prompt_digest",
        "mm_hashes", "conn")


def prompt_digest(request: Request) -> str:
    """sha256 of what the prompt's KV depends on: its token ids, cache salt, placeholders' spans."""
    ids = request.prompt_token_ids
    h = hashlib.sha256(b"fdplug-pd-v1")
    h.update(struct.pack(f"<I{len(ids)}q", len(ids), *ids))
    h.update(msgpack.packb([request.cache_salt, [[p.offset, p.length] for p in request.mm_positions]]))
    return h.hexdigest()


def _canonical(value: Any) -> Any:
    """Dicts as key-sorted pairs: the same bytes whatever order JSON hops left the keys in."""
    if isinstance(value, dict):
        return [[k, _canonical(value[k])] for k in sorted(value)]
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def signature(params: dict, secret: str) -> str:
    body = msgpack.packb(_canonical({k: params.get(k) for k in KEYS}))
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def make_params(request: Request, connector: str, block_size: int, conn: dict, secret: str | None) -> dict:
    """The params of a request a prefill instance finished (its first token is its only output)."""
    params = {"connector": connector, "first_token": request.output_token_ids[0],
              "num_prompt_tokens": request.num_prompt_tokens, "num_cached_tokens": request.num_cached_tokens,
              "block_size": block_size,
              "prompt_digest": prompt_digest(request), "mm_hashes": [p.mm_hash for p in request.mm_positions],
              "conn": conn}
    if secret:
        params["sig"] = signature(params, secret)
    return params


MAX_CONN_DEPTH = 8
"""How deep a ``conn`` may nest (the built-in connectors' are flat): deeper is no connector's."""


def plain_conn(conn: Any) -> bool:
    """A dict of str keys with JSON values (str, int, float, bool, None, lists and dicts of them),
    at most `MAX_CONN_DEPTH` deep: what may be hashed, packed and handed to a connector's ``check``
    without a recursion or a type a serializer chokes on (walked without recursing)."""
    if not isinstance(conn, dict):
        return False
    stack: list[tuple[Any, int]] = [(conn, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if depth > MAX_CONN_DEPTH or not all(isinstance(k, str) for k in value):
                return False
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            if depth > MAX_CONN_DEPTH:
                return False
            stack.extend((v, depth + 1) for v in value)
        elif not (value is None or isinstance(value, (str, int, float, bool))):
            return False
    return True


def is_count(value: Any, low: int, high: int) -> bool:
    """An int (not a bool) in ``[low, high)``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def bad(why: str, fix: str = "pass the kv_transfer_params the prefill instance returned, unchanged.") -> None:
    """A 400 naming the field: ``kv_transfer_params <why>.``"""
    raise InvalidRequestError(f"kv_transfer_params {why}.", fix=fix, param="kv_transfer_params")


def _first_logprobs_fit(value: Any, first_token: int, wanted: int, vocab_size: int) -> bool:
    """``[ids, logprobs, ranks]`` of the first token and its top ``wanted``, as a prefill instance
    returns them (`fdplug.core.worker.sampling.sampled_logprobs`)."""
    if not (isinstance(value, list) and len(value) == 3 and all(isinstance(part, list) for part in value)):
        return False
    ids, logprobs, ranks = value
    return (len(ids) == len(logprobs) == len(ranks) == wanted + 1 and ids[0] == first_token
            and all(is_count(i, 0, vocab_size) for i in ids) and all(is_count(r, 1, 1 << 31) for r in ranks)
            and all(isinstance(x, float) and x <= 0.0 for x in logprobs))


def check_params(params: dict, request: Request, connector: str, block_size: int, secret: str | None,
                 vocab_size: int) -> None:
    """A 400 unless ``params`` came from a prefill instance for this very prompt, through this
    instance's connector (and, with ``secret``, signed with it), with values this model takes."""
    conn = params.get("conn")
    if not plain_conn(conn) or not isinstance(conn.get("transfer_id"), str):
        bad("have no conn (where the prompt's KV waits) of a connector's form")
    if secret is not None:
        sig = params.get("sig")
        if not isinstance(sig, str) or not hmac.compare_digest(sig, signature(params, secret)):
            bad("are not signed with this decode instance's FDPLUG_PD_SECRET",
                fix="set the same FDPLUG_PD_SECRET on the prefill and decode instances.")
    if params.get("connector") != connector:
        bad(f"are for the {params.get('connector')!r} KV connector; this instance uses {connector!r}",
            fix="start the prefill and decode instances with the same --kv-connector.")
    if params.get("block_size") != block_size:
        bad(f"have block size {params.get('block_size')!r}; this instance uses {block_size}",
            fix="start the prefill and decode instances with the same --block-size.")
    if (params.get("num_prompt_tokens") != request.num_prompt_tokens
            or params.get("prompt_digest") != prompt_digest(request)):
        bad("describe another prompt than this request's (its tokens, cache salt or multimodal items differ)")
    if not is_count(params.get("first_token"), 0, vocab_size) \
            or not is_count(params.get("num_cached_tokens"), 0, request.num_prompt_tokens + 1):
        bad(f"have a first_token outside this model's vocabulary ({vocab_size}) or a num_cached_tokens outside "
            "the prompt")
    wanted = request.sampling_params.logprobs
    if wanted is not None and not _first_logprobs_fit(params.get("first_logprobs"), params["first_token"], wanted,
                                                      vocab_size):
        bad(f"have no first_logprobs for the first token and its top {wanted} (the request asks for logprobs)",
            fix="send the prefill instance the same logprobs parameters (fdplug router does).")
    hashes = params.get("mm_hashes")
    if not isinstance(hashes, list) or len(hashes) != len(request.mm_positions) \
            or not all(isinstance(h, str) and 0 < len(h) <= 128 for h in hashes):
        bad("do not name one identity per multimodal item of the prompt")
