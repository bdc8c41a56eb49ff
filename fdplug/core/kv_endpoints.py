"""``--kv-port`` and ``--kv-peers`` (`EngineConfig.kv_port`, ``kv_peers``): their settings and their checks.

What the configuration holds of PD disaggregation's addresses, checked where the configuration is
made (`fdplug.core.config`); what a running instance does with them (resolving, trusting, binding)
is `fdplug.core.kv_transfer.peers`'.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from typing import Any

from fdplug.errors import ConfigError
from fdplug.plugin_api.settings import Setting, declare, parse_list

MAX_PEER_PORTS = 4096
"""The most endpoints ``--kv-peers`` may name (ranges included): a mistyped range is an error, not a huge set."""

_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}))*\.?")
_ENDPOINT = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]{2,45})\]|(?P<host>[A-Za-z0-9.\-]{1,253})):"
                       r"(?P<first>[0-9]{1,5})(?:-(?P<last>[0-9]{1,5}))?")
def normal_host(host: str) -> str:
    """An IP address in its one canonical spelling, a host name in lower case; a ValueError for anything else."""
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        pass
    if len(host) > 253 or not _NAME.fullmatch(host):
        raise ValueError(f"{host[:80]!r} is not an IP address or a host name")
    return host.rstrip(".").lower()


def parse_port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is not in 1..65535")
    return port


def parse_endpoints(spec: str) -> list[tuple[str, int]]:
    """``HOST:PORT`` or ``HOST:FIRST-LAST`` (IPv6 in brackets) -> ``[(host, port), ...]``; a ValueError
    saying why for anything else."""
    match = _ENDPOINT.fullmatch(spec.strip())
    if match is None:
        raise ValueError(f"{spec[:80]!r} is not HOST:PORT or HOST:FIRST-LAST "
                         f"(e.g. 10.0.0.5:5600 or prefill-1:5600-5603)")
    v6 = match.group("v6")
    if v6 is not None and not isinstance(ipaddress.ip_address(v6), ipaddress.IPv6Address):
        raise ValueError(f"{spec[:80]!r}: only IPv6 addresses go in brackets")
    host = normal_host(v6 if v6 is not None else match.group("host"))
    first = parse_port(match.group("first"))
    last = parse_port(match.group("last")) if match.group("last") else first
    if last < first or last - first >= MAX_PEER_PORTS:
        raise ValueError(f"{spec[:80]!r}: the range {first}-{last} is empty or longer than {MAX_PEER_PORTS} ports")
    return [(host, port) for port in range(first, last + 1)]


def parse_peers(raw: str | Iterable[str]) -> tuple[str, ...]:
    """``FDPLUG_KV_PEERS`` / ``--kv-peers`` (comma-separated, repeatable) -> the specs, each checked."""
    specs = parse_list(raw if isinstance(raw, str) else ",".join(map(str, raw)))
    count = sum(len(parse_endpoints(spec)) for spec in specs)
    if count > MAX_PEER_PORTS:
        raise ValueError(f"they name {count} endpoints, more than {MAX_PEER_PORTS}")
    return specs


KV_PORT = declare(Setting(
    "FDPLUG_KV_PORT", None, parse_port,
    "PD prefill: the port decode instances pull KV from, on FDPLUG_KV_HOST (--kv-port; default: a free port, logged "
    "at startup). Data-parallel engines take the first free ports from it on (port, port+1, ...)."))
KV_PEERS = declare(Setting(
    "FDPLUG_KV_PEERS", (), parse_peers,
    "PD decode: comma-separated HOST:PORT (or HOST:FIRST-LAST) KV endpoints of the prefill instances this decode "
    "instance may pull from (--kv-peers); conns naming any other address are refused (400). A decode instance "
    "needs these or FDPLUG_PD_SECRET."))


def check_kv_fields(kv_port: Any, kv_peers: Any) -> tuple[int | None, tuple[str, ...]]:
    """`EngineConfig`'s ``kv_port`` and ``kv_peers``, checked (a ConfigError naming the field) and normalised."""
    if kv_port is not None and not _is_port(kv_port):
        raise ConfigError(f"kv_port must be a port number 1..65535, got {kv_port!r}.",
                          fix="give the port decode instances pull KV from (--kv-port), "
                              "or leave it unset for a free one.")
    if isinstance(kv_peers, str):
        kv_peers = (kv_peers,)
    if not isinstance(kv_peers, (tuple, list)) or not all(isinstance(p, str) for p in kv_peers):
        raise ConfigError(f"kv_peers must be a list of HOST:PORT strings, got {kv_peers!r:.80}.",
                          fix="give e.g. kv_peers=('10.0.0.5:5600',) (--kv-peers 10.0.0.5:5600).")
    try:
        peers = parse_peers(kv_peers)
    except ValueError as exc:
        raise ConfigError(f"kv_peers: {exc}.",
                          fix="name each prefill instance's KV endpoint as HOST:PORT or HOST:FIRST-LAST "
                              "(it logs it at startup; fix it with --kv-port on the prefill side).") from None
    return kv_port, peers




def _is_port(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535
