"""Gateways found by DNS: a worker given `--gateway-dns NAME` links to every address NAME has.

A tier of gateway replicas (a Kubernetes Deployment behind a headless Service, or any DNS
name with several A/AAAA records) shares one CurveZMQ key pair, so a worker needs only the
name and the two ports every gateway binds. A thread re-resolves the name every
`interval_s` and, when the set of addresses changes, puts a `GatewaysFound` into the engine
thread's inbox; the engine thread (worker/process.py) adds a link per new address and
retires the links whose address left the answer.

Resolution never blocks the engine thread (getaddrinfo may take seconds), and a failed
lookup (NXDOMAIN while no gateway pod exists yet, a DNS server that is away) changes
nothing: the worker keeps the links it has and asks again on the next tick. Only an answer
says an address is gone.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("zeroserve.worker")

# A hostname -> its addresses (IPv4 or IPv6 literals). Raises OSError when the lookup fails.
Resolver = Callable[[str], list[str]]


def resolve_all(name: str) -> list[str]:
    """Every address `name` has (A and AAAA), sorted and without repeats."""
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


@dataclass(frozen=True)
class GatewayDns:
    """Where a worker finds its gateways: a name and the ports each gateway binds."""

    name: str
    router_port: int = 5555
    tokens_port: int = 5556
    interval_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or ":" in self.name:
            raise ValueError(f"gateway DNS name {self.name!r}: give a host name, without "
                             "scheme or port")
        for port in (self.router_port, self.tokens_port):
            if not 0 < port < 65536:
                raise ValueError(f"gateway port {port} is out of range")
        if self.router_port == self.tokens_port:
            raise ValueError("the gateway's router and tokens ports must differ")
        if self.interval_s <= 0:
            raise ValueError("the gateway DNS interval must be > 0")

    def endpoints(self, address: str) -> tuple[str, str]:
        """One gateway's (router, tokens) ZeroMQ endpoints at `address`."""
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        return f"tcp://{host}:{self.router_port}", f"tcp://{host}:{self.tokens_port}"

    @property
    def example_endpoints(self) -> tuple[str, str]:
        """The endpoints as the name itself spells them (for messages and checks)."""
        return (f"tcp://{self.name}:{self.router_port}", f"tcp://{self.name}:{self.tokens_port}")


@dataclass(frozen=True)
class GatewaysFound:
    """Put in the engine thread's inbox: the (router, tokens) pairs of the latest answer."""

    endpoints: tuple[tuple[str, str], ...]


class GatewayDiscovery(threading.Thread):
    """Resolves `dns.name` now and every `dns.interval_s`; reports each changed answer."""

    def __init__(self, dns: GatewayDns, inbox: queue.Queue, worker_id: str,
                 resolver: Resolver | None = None):
        super().__init__(name="gateway-discovery", daemon=True)
        self.dns = dns
        self._inbox = inbox
        self._resolver = resolver or resolve_all
        self._stopping = threading.Event()
        self._log_extra = {"worker_id": worker_id, "gateway_dns": dns.name}

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        last: tuple[str, ...] | None = None
        has_failed = False
        while not self._stopping.is_set():
            try:
                addresses = tuple(sorted(set(self._resolver(self.dns.name))))
            except (OSError, UnicodeError) as e:
                if not has_failed:  # once per outage, not every tick
                    log.warning("cannot resolve the gateways' name: %s; keeping the links "
                                "we have", e, extra=self._log_extra)
                has_failed = True
            else:
                if has_failed:
                    log.info("the gateways' name resolves again", extra=self._log_extra)
                has_failed = False
                addresses = tuple(a for a in addresses if _is_ip(a))
                if addresses and addresses != last:
                    log.info("gateways found: %s", ", ".join(addresses), extra=self._log_extra)
                    last = addresses
                    self._inbox.put((None, GatewaysFound(
                        tuple(self.dns.endpoints(a) for a in addresses))))
            self._stopping.wait(self.dns.interval_s)


def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True
