"""One node's discovery, as the agent runs it: bind the probe port (UDP + TCP, same number), announce
and listen over unicast and (optionally) mDNS, measure links to verified peers, and expose the
current peer table (`snapshot`) for the agent to report to the control plane.

The probe port serves only key holders (see `links` and `unicast`), and nothing found here is
trusted by the control plane as more than a report: placement still pins work to registered nodes.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from dataclasses import dataclass, field

from computepool.discovery.announce import Announcement, DeviceSummary, fingerprint, new_instance
from computepool.discovery.links import BandwidthServer, measure_bandwidth, measure_rtt
from computepool.discovery.mdns import MdnsTransport
from computepool.discovery.registry import PeerView, Registry, Target
from computepool.discovery.unicast import UnicastEndpoint, parse_peer

log = logging.getLogger(__name__)

_BANDWIDTH_TRIES = 3


@dataclass(frozen=True)
class DiscoveryConfig:
    key: bytes = field(repr=False)  # the pool's discovery key (derive_key output); a secret
    node_id: str  # the node's registered name
    address: str  # IP to announce and to bind the probe port on
    port: int = 0  # UDP+TCP probe port; 0 = ephemeral (then `Discovery.port`)
    devices: tuple[DeviceSummary, ...] = ()
    peers: tuple[str, ...] = ()  # unicast fallback: "HOST:PORT" of other nodes' probe ports
    mdns: bool = True  # announce and browse with python-zeroconf
    announce_every_s: float = 5.0
    expire_after_s: float = 30.0  # a peer not heard from this long is dropped
    measure_every_s: float = 30.0  # links (RTT, bandwidth) to verified peers re-measured


class Discovery:
    """Threads only, no asyncio: safe to run beside the agent's own loop. `address` must be an IPv4
    address of this host (the probe sockets bind to it and mDNS runs on its interface only). A bad
    configuration raises ValueError naming the field, before anything is bound."""

    def __init__(self, config: DiscoveryConfig) -> None:
        for peer in config.peers:
            parse_peer(peer)  # a bad --peer fails here, in words, not later in a thread
        try:
            socket.inet_aton(config.address)
            Announcement(
                fingerprint(config.key), config.node_id, "0", config.address, 1, 0.0, config.devices
            ).checked()
        except (OSError, ValueError) as e:
            what = str(e).removeprefix("malformed announcement: ")
            raise ValueError(
                f"discovery: {what if isinstance(e, ValueError) else 'address must be an IPv4 address'}"
            ) from None
        self.config = config
        self.instance = new_instance()
        self._started_at = time.time()
        self._pool = fingerprint(config.key)
        self._stop = threading.Event()
        self._registry = Registry(
            config.key,
            node_id=config.node_id,
            instance=self.instance,
            started_at=self._started_at,
            expire_after_s=config.expire_after_s,
        )
        self._udp: socket.socket | None = None
        self._tcp: socket.socket | None = None
        self._port = 0
        self._parts: list[UnicastEndpoint | BandwidthServer] = []
        self._mdns: MdnsTransport | None = None
        self._prober = threading.Thread(target=self._measure_loop, name="cpool-discovery-links", daemon=True)
        self._state = threading.Lock()
        self._started = False
        self._stopped = False

    @property
    def port(self) -> int:
        return self._port

    def announcement(self) -> Announcement:
        """This node's announcement, signed now."""
        return Announcement(
            pool=self._pool,
            node_id=self.config.node_id,
            instance=self.instance,
            address=self.config.address,
            port=self._port,
            issued_at=time.time(),
            devices=self.config.devices,
        ).signed(self.config.key)

    def start(self) -> None:
        """Binds the probe port (OSError when it is taken) and starts the threads."""
        with self._state:
            if self._started:
                raise RuntimeError("discovery already started")
            self._started = True
            self._udp, self._tcp = _bind_pair(self.config.address, self.config.port)
            self._port = self._udp.getsockname()[1]
            unicast = UnicastEndpoint(
                key=self.config.key,
                sock=self._udp,
                registry=self._registry,
                announcement=self.announcement,
                peers=self.config.peers,
                announce_every_s=self.config.announce_every_s,
                stop=self._stop,
            )
            bandwidth = BandwidthServer(
                self.config.key, self._tcp, self._stop, node_id=self.config.node_id, instance=self.instance
            )
            self._parts = [unicast, bandwidth]
            unicast.start()
            bandwidth.start()
            self._prober.start()
            if self.config.mdns:
                self._mdns = MdnsTransport(
                    address=self.config.address,
                    registry=self._registry,
                    announcement=self.announcement,
                    announce_every_s=self.config.announce_every_s,
                    stop=self._stop,
                )
                self._mdns.start()

    def stop(self) -> None:
        """Idempotent and quick (well under a few seconds): the agent calls it on its way out."""
        with self._state:
            if self._stopped:
                return
            self._stopped = True
            self._stop.set()
        if self._mdns is not None:
            self._mdns.close()
        for part in self._parts:
            part.join(1.0)
        if self._prober.is_alive():
            self._prober.join(1.0)
        for sock in (self._udp, self._tcp):
            if sock is not None:
                sock.close()

    def snapshot(self) -> list[PeerView]:
        return self._registry.snapshot(time.time())

    # -- link measurement ---------------------------------------------------------------------

    def _measure_loop(self) -> None:
        """Measures a peer as soon as it first verifies (or comes back as a new instance), then
        every `measure_every_s`; one at a time, so probing never competes with itself."""
        last: dict[tuple[str, str], float] = {}
        while not self._stop.is_set():
            now = time.time()
            targets = self._registry.targets(now)
            live = {(t.node_id, t.instance) for t in targets}
            last = {k: v for k, v in last.items() if k in live}
            for t in targets:
                if self._stop.is_set():
                    return
                key = (t.node_id, t.instance)
                if t.measured and now - last.get(key, 0.0) < self.config.measure_every_s:
                    continue
                if not t.measured and now - last.get(key, 0.0) < min(5.0, self.config.measure_every_s):
                    continue  # it failed a moment ago; do not hammer it
                last[key] = now
                try:
                    self._measure(t)
                except Exception:  # one odd peer must never end link measurement for all of them
                    log.exception("measuring the link to %s at %s:%s failed", t.node_id, t.address, t.port)
            self._stop.wait(0.25)

    def _measure(self, t: Target) -> None:
        """RTT, then bandwidth, to the very node and instance the signed announcement names."""
        key, here = self.config.key, self.config.address
        rtt = measure_rtt(key, here, t.address, t.port, node_id=t.node_id, instance=t.instance)
        bw = None
        for attempt in range(_BANDWIDTH_TRIES if rtt is not None else 0):
            # A refused transfer is often only a busy slot (the peer serves one per source
            # address: several nodes on one host, or one machine's loopback, take turns).
            if attempt and self._stop.wait(random.uniform(0.2, 1.0)):
                return
            bw = measure_bandwidth(key, here, t.address, t.port, node_id=t.node_id, instance=t.instance)
            if bw is not None:
                break
        # A failed re-measurement clears old figures: an unreachable link is not a fast one.
        self._registry.set_link(t.node_id, t.instance, rtt, bw)


def _bind_pair(address: str, port: int) -> tuple[socket.socket, socket.socket]:
    """A UDP and a listening TCP socket on one port number (an ephemeral one when `port` is 0)."""
    for _ in range(20 if port == 0 else 1):
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            udp.bind((address, port))
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.bind((address, udp.getsockname()[1]))
            tcp.listen(8)
            return udp, tcp
        except OSError:
            udp.close()
            tcp.close()
            if port != 0:
                raise
    raise OSError(f"no free port on {address} for both UDP and TCP")


__all__ = ["Discovery", "DiscoveryConfig", "PeerView"]
