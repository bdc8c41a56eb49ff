"""Which prefill instances a decode instance may pull KV from, and where a prefill instance listens.

A decode instance connects to the address in a request's ``kv_transfer_params``. Those params come
from the client (through the router, or written by hand), so the address may be anyone's: left
alone, an instance would open connections wherever a client points it (a server-side request
forgery). Two things make that address trustworthy, and a decode instance needs one of them to start
(`check_decode_trust`):

- ``FDPLUG_PD_SECRET``, shared with the prefill instances: they sign the params, and a signature
  proves a prefill instance wrote the address;
- ``--kv-peers HOST:PORT`` (``FDPLUG_KV_PEERS``): the KV endpoints of the prefill instances it may
  pull from. A conn naming any other address is a 400 before a socket is made, signed or not.

To name a prefill instance's endpoint, fix it: ``--kv-port PORT`` (``FDPLUG_KV_PORT``) on the
prefill instance, with ``FDPLUG_KV_HOST`` its address; it logs the endpoint at startup. Its
data-parallel engines each listen on one port: the first free one from ``PORT`` on (with N engines,
``PORT`` to ``PORT+N-1`` unless something else holds one), so a decode instance names them all,
``HOST:PORT-LAST``. Host names in ``--kv-peers`` are resolved once, at startup: a client's address
is only ever compared with the result, never looked up.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
from collections.abc import Iterable
from typing import Any

from fdplug.core.kv_endpoints import normal_host, parse_endpoints, parse_port
from fdplug.errors import ConfigError

logger = logging.getLogger("fdplug.kv_transfer")

PORT_SPAN = 64
"""How many ports from ``--kv-port`` on a prefill instance's engines may take (its data-parallel size at most)."""
_TCP = re.compile(r"tcp://(?:\[(?P<v6>[0-9A-Fa-f:.]{2,45})\]|(?P<host>[A-Za-z0-9.\-]{1,253})):(?P<port>[0-9]{1,5})")


def split_tcp_address(address: Any) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> ``(normal host, port)``; a ValueError for anything else (what a client
    wrote never reaches a socket unless it is exactly that)."""
    match = _TCP.fullmatch(address) if isinstance(address, str) else None
    if match is None:
        raise ValueError(f"conn's addr {str(address)[:80]!r} is not a tcp://host:port address")
    host = match.group("v6") if match.group("v6") is not None else match.group("host")
    try:
        return normal_host(host), parse_port(match.group("port"))
    except ValueError as exc:
        raise ValueError(f"conn's addr {address[:80]!r} is not a tcp://host:port address ({exc})") from None


def tcp_address(host: str, port: int) -> str:
    """The ZMQ address of ``(host, port)`` (IPv6 in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


def sender_address(host: str, port: int) -> tuple[str, int]:
    """``(ZMQ address, port span)`` a sender binds: ``host`` (``FDPLUG_KV_HOST``) at ``port``
    (``--kv-port``: the first free of `PORT_SPAN` ports from it on, one per data-parallel engine),
    or at a free port when ``port`` is 0."""
    return tcp_address(host, port), PORT_SPAN if port else 1


def resolve_peers(specs: Iterable[str]) -> frozenset[tuple[str, int]]:
    """The ``(host, port)`` endpoints ``specs`` name: each host as written, and, for a host name,
    every address it resolves to now (a prefill instance's conn carries the address it bound)."""
    endpoints: set[tuple[str, int]] = set()
    for spec in specs:
        pairs = parse_endpoints(spec)
        host = pairs[0][0]
        hosts = {host}
        try:
            ipaddress.ip_address(host)
        except ValueError:
            try:
                hosts |= {normal_host(info[4][0].split("%")[0]) for info in socket.getaddrinfo(host, None,
                                                                                              type=socket.SOCK_STREAM)}
            except OSError as exc:
                logger.warning("--kv-peers %s: %s does not resolve (%s); only conns naming it by that name are taken",
                               spec, host, exc)
        endpoints |= {(h, port) for h in hosts for _, port in pairs}
    return frozenset(endpoints)


def check_decode_trust(config: Any, secret: str | None) -> None:
    """A decode instance must be able to trust the address it pulls from: the secret or named peers."""
    if getattr(config, "kv_role", None) == "decode" and not secret and not getattr(config, "kv_peers", ()):
        raise ConfigError(
            "a decode instance without FDPLUG_PD_SECRET would connect to any host:port a client writes into "
            "kv_transfer_params; it will not start without knowing which prefill instances it may pull from.",
            fix="set the same FDPLUG_PD_SECRET on prefill and decode, or name the prefill instances' KV endpoints "
                "with --kv-peers HOST:PORT (FDPLUG_KV_PEERS; a prefill instance logs its endpoint at startup, "
                "--kv-port fixes it).")
