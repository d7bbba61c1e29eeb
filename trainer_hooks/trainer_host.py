"""Which address of the trainer the sidecars dial for a weight transfer's store.

The sender (rank 0 of the transfer group) listens there, and every receiving rank of every replica
dials it. On one machine that is loopback (nothing else can reach the store). When a sidecar runs on
another machine (a Ray fleet across nodes, docs/fleet.md), loopback would make its ranks dial
themselves: the address is then the one of this machine's interfaces that routes to that sidecar,
which the kernel tells without sending a packet (a UDP socket's connect only picks the route).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"


def is_local(host: str) -> bool:
    """True for loopback names and addresses, and for this machine's own name."""
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def route_to(host: str, port: int) -> str:
    """The local address the kernel would use to reach host:port (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
        except OSError as e:
            raise OSError(f"no route from this machine to the sidecar at {host}:{port} ({e}): give "
                          "WeightSyncHook(trainer_host=...) the address the sidecars reach the trainer at") from e
        return str(probe.getsockname()[0])


def trainer_host(urls: Iterable[str]) -> str:
    """Loopback when every sidecar URL is on this machine, else the local address that routes to the
    first remote one (sidecars on several networks need WeightSyncHook(trainer_host=...))."""
    for url in urls:
        parts = urlsplit(url)
        host = parts.hostname or LOOPBACK
        if not is_local(host):
            return route_to(host, parts.port or 80)
    return LOOPBACK
