"""``kv_transfer_params`` at the HTTP boundary (vLLM's field): checked before anything reaches an engine.

Only an instance started with ``--role`` takes it. A prefill instance takes exactly
``{"do_remote_decode": true}``; a decode instance what a prefill instance returned
(`fdplug.core.kv_transfer.params`): here their shape, types and sizes (``conn``: JSON values, a
few levels deep, a few KiB); the engine checks them again against the prompt (its digest, the
connector, the block size, the signature) and the connector's ``check`` refuses a ``conn`` it
did not make or aimed at an address this instance may not pull from (``--kv-peers``), before any I/O.
"""

from __future__ import annotations

import re
from typing import Any

import msgpack

from fdplug.core.kv_transfer.params import KEYS, is_count, plain_conn
from fdplug.core.kv_transfer.params import bad as _bad

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
MAX_CONN_BYTES = 4096
MAX_ITEMS = 4096


def _small_str(value: Any, limit: int = 128) -> bool:
    return isinstance(value, str) and 0 < len(value) <= limit


def check_kv_transfer_params(params: dict | None, role: str | None, n: int, vocab_size: int,
                             num_prompts: int = 1) -> dict | None:
    """``params`` if this instance (``role``) may take them, else a 400 naming what is wrong."""
    if params is None:
        return None
    if role is None:
        _bad("is only taken by a prefill or decode instance", fix="remove it, or send the request to an instance "
             "started with `fdplug serve --role prefill|decode` (or through `fdplug router`).")
    if n != 1 or num_prompts != 1:
        _bad(f"are for one sequence of one prompt (n is {n}, prompts {num_prompts})",
             fix="send one prompt with n=1 with kv_transfer_params.")
    if role == "prefill":
        if params != {"do_remote_decode": True}:
            _bad('for a prefill instance must be {"do_remote_decode": true}', fix='send {"do_remote_decode": true}.')
        return params
    if not set(KEYS) <= set(params) <= {*KEYS, "sig", "first_logprobs"}:
        _bad(f"for a decode instance must hold {', '.join(KEYS)} (and sig when signed, first_logprobs with "
             "logprobs), nothing else")
    first_logprobs = params.get("first_logprobs")
    if first_logprobs is not None and not (isinstance(first_logprobs, list) and len(first_logprobs) == 3
                                           and all(isinstance(p, list) and len(p) <= 64 for p in first_logprobs)):
        _bad("have first_logprobs that are not [ids, logprobs, ranks]")
    if not is_count(params["first_token"], 0, vocab_size) or not is_count(params["num_prompt_tokens"], 1, 1 << 31) \
            or not is_count(params["num_cached_tokens"], 0, params["num_prompt_tokens"] + 1) \
            or not is_count(params["block_size"], 1, 1 << 16):
        _bad("have a first_token, num_prompt_tokens, num_cached_tokens or block_size out of range")
    if not _small_str(params["connector"], 64) or not isinstance(params["prompt_digest"], str) \
            or not _HEX64.match(params["prompt_digest"]) or ("sig" in params and not (
                isinstance(params["sig"], str) and _HEX64.match(params["sig"]))):
        _bad("have a connector, prompt_digest or sig that is not what a prefill instance returns")
    hashes = params["mm_hashes"]
    if not isinstance(hashes, list) or len(hashes) > MAX_ITEMS or not all(_small_str(h) for h in hashes):
        _bad("have mm_hashes that are not a list of item identities")
    conn = params["conn"]
    try:
        packed = msgpack.packb(conn) if plain_conn(conn) else b""
    except (TypeError, ValueError, OverflowError):
        packed = b""
    if not packed or not _small_str(conn.get("transfer_id")) or len(packed) > MAX_CONN_BYTES:
        _bad(f"have a conn that is not a connector's (a JSON object of at most {MAX_CONN_BYTES} bytes"
             f" with a transfer_id)")
    return params
