"""The agent's side of LAN discovery: fetch the pool's discovery key with the node credential, run
`Discovery` (announce, browse, measure links) and report what it sees to the control plane.

Discovery is an extra: a control plane too old to have it, or a probe port that cannot be bound,
costs a log line, never the agent. The key is a secret and is never logged.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from computepool.agent.api import AgentApi, ApiError, Unreachable
from computepool.agent.config import DiscoveryOptions
from computepool.agent.devices import NodeInventory
from computepool.discovery.announce import DeviceSummary

if TYPE_CHECKING:  # python-zeroconf loads only in agents that run discovery
    from computepool.discovery.runner import Discovery, DiscoveryConfig, PeerView

log = logging.getLogger("computepool.agent")

MAX_PEERS_PER_REPORT = 256  # wire/peers.py's bound
_MODEL_BAD = re.compile(r"[^A-Za-z0-9 _.:/()+-]")


def route_address(server: str) -> str:
    """The local IPv4 address this host uses to reach `server` (a connected UDP socket sends
    nothing); loopback when that fails, never the wildcard."""
    parts = urlsplit(server)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        target = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, port))
            found = str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    return "127.0.0.1" if found == "0.0.0.0" else found


def announce_address(options: DiscoveryOptions, agent_address: str | None, server: str) -> str:
    """--discovery-address, else --address (resolved when it is a name), else the route to the server."""
    if options.address:
        return options.address
    if agent_address:
        try:
            ipaddress.IPv4Address(agent_address)
            return agent_address
        except ValueError:
            try:
                return socket.gethostbyname(agent_address)
            except OSError:
                log.warning(
                    "discovery: cannot resolve --address %r; using the route to the server", agent_address
                )
    return route_address(server)


def device_summaries(inventory: NodeInventory) -> tuple[DeviceSummary, ...]:
    """Each GPU, then the CPU with the host's memory: what peers (and the planner) may count on."""

    def model(text: str, default: str) -> str:
        return _MODEL_BAD.sub("-", text.strip())[:64] or default

    gpus = [DeviceSummary(d.index, "gpu", model(d.model, "gpu"), d.memory_mib) for d in inventory.devices]
    cpu = DeviceSummary(0, "cpu", model(inventory.cpu.model, "cpu"), inventory.cpu.memory_mib)
    return (*gpus, cpu)


def peer_reports(views: Sequence[PeerView]) -> list[dict[str, Any]]:
    """PeerView → the wire's PeerReport (wire/peers.py, as JSON: the agent does not load
    the server's modules); verified peers first when there are too many to send."""
    out = []
    for v in sorted(views, key=lambda v: (v.status != "ok", v.peer_key))[:MAX_PEERS_PER_REPORT]:
        out.append(
            {
                "peer_key": v.peer_key[:160],
                "node_id": v.node_id,
                "instance": v.instance[:64],
                "address": v.address[:253],
                "port": v.port,
                "devices": [
                    {"index": d.index, "kind": d.kind, "model": d.model, "memory_mib": d.memory_mib}
                    for d in v.devices[:64]
                ],
                "status": v.status,
                "reason": v.reason[:512],
                "source": v.source,
                "rtt_ms": v.rtt_ms,
                "bandwidth_mbps": v.bandwidth_mbps,
                "last_seen": datetime.fromtimestamp(v.last_seen, UTC).isoformat(),
            }
        )
    return out


class DiscoveryLink:
    """One thread: the key (retried with back-off), then Discovery, then a report every few seconds."""

    def __init__(
        self,
        api: AgentApi,
        name: str,
        address: str,
        devices: tuple[DeviceSummary, ...],
        options: DiscoveryOptions,
    ) -> None:
        self.api, self.name, self.address, self.devices, self.options = api, name, address, devices, options
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpool-discovery", daemon=True)
        self.discovery: Discovery | None = None
        self.reports = 0  # reports the control plane accepted
        self._sent: tuple[object, ...] | None = None  # what the last accepted report said
        self._sent_at = 0.0

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stops reporting and discovery (unregisters the mDNS service); quick, idempotent."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        if self.discovery is not None:
            self.discovery.stop()

    def _run(self) -> None:
        from computepool.discovery.runner import Discovery

        key = self._fetch_key()
        if key is None:
            return
        delay = 1.0
        while not self._stop.is_set():
            try:
                d = Discovery(self._config(key))
                d.start()
            except (OSError, ValueError) as e:  # the port taken, an address not on this host …
                log.warning("discovery: cannot start (%s); retrying in %.0f s", e, delay)
                self._stop.wait(delay)
                delay = min(60.0, delay * 2)
                continue
            self.discovery = d
            if self._stop.is_set():  # closed while it started
                d.stop()
                return
            log.info("discovery: announcing node '%s' on %s:%d", self.name, d.config.address, d.port)
            break
        while not self._stop.wait(self.options.report_every_s):
            self._report()

    def _config(self, key: bytes) -> DiscoveryConfig:
        from computepool.discovery.runner import DiscoveryConfig

        o = self.options
        return DiscoveryConfig(
            key=key,
            node_id=self.name,
            address=self.address,
            port=o.port,
            devices=self.devices,
            peers=o.peers,
            mdns=o.mdns,
            announce_every_s=o.announce_every_s,
            measure_every_s=o.measure_every_s,
        )

    def _fetch_key(self) -> bytes | None:
        delay = 0.5
        while not self._stop.is_set():
            try:
                got = self.api.discovery_key()
                return bytes.fromhex(str(got["key"]))
            except ApiError as e:
                if e.status == 404:
                    log.warning(
                        "discovery: the control plane has no discovery (an older version); running without"
                    )
                else:
                    log.warning("discovery: the key was refused (HTTP %d); running without", e.status)
                return None
            except (Unreachable, KeyError, TypeError, ValueError):
                self._stop.wait(delay)
                delay = min(30.0, delay * 2)
        return None

    def _report(self) -> None:
        d = self.discovery
        if d is None:
            return
        peers = peer_reports(d.snapshot())
        # Unchanged views are sent again only now and then (their last_seen): a pool of many nodes
        # must not rewrite every node's rows every few seconds for nothing.
        view = tuple(tuple(v for k, v in p.items() if k != "last_seen") for p in peers)
        now = time.monotonic()
        if view == self._sent and now - self._sent_at < self.options.refresh_every_s:
            return
        try:
            self.api.report_peers(self.name, peers)
            self.reports += 1
            self._sent, self._sent_at = view, now
        except Unreachable:
            pass  # the next report carries the whole view anyway
        except ApiError as e:
            log.warning("discovery: the control plane refused the peers report: HTTP %d %s", e.status, e)


def start_discovery(
    api: AgentApi,
    name: str,
    inventory: NodeInventory,
    options: DiscoveryOptions | None,
    *,
    agent_address: str | None,
    server: str,
) -> DiscoveryLink | None:
    """Start discovery for the joined node `name` when asked for (None otherwise)."""
    if options is None:
        return None
    address = announce_address(options, agent_address, server)
    link = DiscoveryLink(api, name, address, device_summaries(inventory), options)
    link.start()
    return link
