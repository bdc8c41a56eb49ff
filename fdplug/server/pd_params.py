"""``kv_transfer_params`` at the HTTP boundary (vLLM's field): checked before anything reaches an engine.

Only an instance started with ``--role`` takes it. A prefill instance takes exactly
``{"do_remote_decode": true}``; a decode instance what a prefill instance returned: the first token,
the prompt's length, the block size and, when the prompt has a full block, ``conn`` (where to pull
it: a ``tcp://`` or ``ipc://`` address and a 128-bit transfer id). The engine checks them again
against the prompt (`fdplug.core.kv_transfer.engine_side`).
"""

from __future__ import annotations

import re
from typing import Any

from fdplug.errors import InvalidRequestError

_TRANSFER_ID = re.compile(r"^[0-9a-f]{32}$")
_ADDRESS = re.compile(r"^(tcp://[A-Za-z0-9.\-\[\]:]{1,200}|ipc:///[^\x00]{1,200})$")


def _bad(why: str, fix: str = "pass the kv_transfer_params the prefill instance returned, unchanged.") -> None:
    raise InvalidRequestError(f"kv_transfer_params {why}.", fix=fix, param="kv_transfer_params")


def _count(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def check_kv_transfer_params(params: dict | None, role: str | None, n: int, vocab_size: int,
                             multimodal: bool = False) -> dict | None:
    """``params`` if this instance (``role``) may take them, else a 400 naming what is wrong."""
    if params is None:
        return None
    if role is None:
        _bad("is only taken by a prefill or decode instance", fix="remove it, or send the request to an instance "
             "started with `fdplug serve --role prefill|decode` (or through `fdplug router`).")
    if multimodal:
        _bad("came with multimodal items: PD does not serve those yet",
             fix="send multimodal requests to an instance without --role.")
    if n != 1:
        _bad(f"asks for one sequence, and n is {n}", fix="send n=1 with kv_transfer_params.")
    if role == "prefill":
        if params != {"do_remote_decode": True}:
            _bad('for a prefill instance must be {"do_remote_decode": true}', fix='send {"do_remote_decode": true}.')
        return params
    if set(params) - {"first_token", "num_prompt_tokens", "block_size", "conn"} or "first_token" not in params:
        _bad("for a decode instance must hold first_token, num_prompt_tokens, block_size and (optionally) conn")
    if not _count(params["first_token"], 0, vocab_size) or not _count(params.get("num_prompt_tokens"), 1, 1 << 31) \
            or not _count(params.get("block_size"), 1, 1 << 16):
        _bad("has a first_token, num_prompt_tokens or block_size out of range")
    conn = params.get("conn")
    if conn is not None and not (isinstance(conn, dict) and set(conn) == {"addr", "transfer_id", "num_blocks"}
                                 and isinstance(conn["addr"], str) and _ADDRESS.match(conn["addr"])
                                 and isinstance(conn["transfer_id"], str) and _TRANSFER_ID.match(conn["transfer_id"])
                                 and _count(conn["num_blocks"], 1, 1 << 31)):
        _bad("has a conn that is not a prefill instance's address and transfer id")
    return params
