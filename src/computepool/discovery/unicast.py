"""The unicast transport, for LANs where multicast is blocked: a UDP socket on the node's probe port
that trades signed announcements with a configured list of peers, and answers link pings.

Wire format (each datagram one JSON object, at most `MAX_DATAGRAM` bytes, UTF-8):

    {"t": "hello", "ann": ANNOUNCEMENT}   sent every `announce_every_s` to each configured peer
    {"t": "ann",   "ann": ANNOUNCEMENT}   the answer to a verified hello (never answered itself)
    {"t": "ping", ...} / {"t": "pong", ...}   link round trips (see `links`)

ANNOUNCEMENT is `Announcement.to_json()`: pool, node_id, instance, address, port, issued_at,
devices (["INDEX:KIND:MEMORY_MIB:MODEL", ...]), signature, version.

Security: every announcement goes through the registry, which verifies it before believing a word.
A hello is answered only when it verified, and the answer goes to the address and port *inside the
signed announcement* (not to the datagram's source, which UDP lets anyone spoof), at most once a
second per node: the socket discloses nothing to non-members and cannot be used to reflect traffic
at a third party. Oversized or unparsable datagrams are recorded as rejected and never stop the
loop.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

from computepool.discovery.announce import Announcement
from computepool.discovery.links import MAX_DATAGRAM, answer_ping
from computepool.discovery.registry import Registry

log = logging.getLogger(__name__)

_ANSWER_EVERY_S = 1.0
_MAX_PONGS_PER_S = 200


def parse_peer(text: str) -> tuple[str, int]:
    """ "HOST:PORT" (a name, an IPv4 address, or [IPv6]) → (host, port); ValueError names the problem."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer {text!r} is not HOST:PORT")
    return host, int(port)


class UnicastEndpoint:
    """Owns the probe port's UDP socket (already bound): one receive thread, one hello thread."""

    def __init__(
        self,
        *,
        key: bytes,
        sock: socket.socket,
        registry: Registry,
        announcement: Callable[[], Announcement],
        peers: Sequence[str],
        announce_every_s: float,
        stop: threading.Event,
    ) -> None:
        self._key = key
        self._sock = sock
        self._registry = registry
        self._announcement = announcement
        self._peers = [parse_peer(p) for p in peers]
        self._every = announce_every_s
        self._stop = stop
        self._answered: dict[str, float] = {}
        self._pongs = (0.0, 0)  # (second, count) for the pong rate cap
        self._threads = [
            threading.Thread(target=self._receive_loop, name="cpool-discovery-udp", daemon=True),
            threading.Thread(target=self._hello_loop, name="cpool-discovery-hello", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self, timeout_s: float) -> None:
        for t in self._threads:
            t.join(timeout_s)

    # -- sending ------------------------------------------------------------------------------

    def _hello_loop(self) -> None:
        while not self._stop.is_set():
            if self._peers:
                body = self._encode("hello", self._announcement())
                for host, port in self._peers:
                    try:
                        self._sock.sendto(body, (host, port))
                    except OSError as e:  # unresolvable or unreachable now; try again next round
                        log.debug("hello to %s:%s failed: %s", host, port, e)
            self._stop.wait(self._every)

    @staticmethod
    def _encode(kind: str, ann: Announcement) -> bytes:
        return json.dumps({"t": kind, "ann": ann.to_json()}, separators=(",", ":")).encode()

    # -- receiving ----------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        self._sock.settimeout(0.25)
        while not self._stop.is_set():
            try:
                data, sender = self._sock.recvfrom(MAX_DATAGRAM + 1)
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)  # e.g. ICMP port unreachable reported on a later recv
                continue
            try:
                self._handle(data, (str(sender[0]), int(sender[1])))
            except Exception:  # one bad datagram must never end discovery
                log.exception("discovery datagram from %s:%s not handled", sender[0], sender[1])

    def _handle(self, data: bytes, sender: tuple[str, int]) -> None:
        now = time.time()
        if len(data) > MAX_DATAGRAM:
            self._malformed(f"datagram over {MAX_DATAGRAM} bytes", sender, now)
            return
        try:
            msg = json.loads(data)
        except ValueError:
            self._malformed("not JSON", sender, now)
            return
        kind = msg.get("t") if isinstance(msg, dict) else None
        if kind == "ping":
            self._pong(msg, sender, now)
        elif kind == "pong":
            pass  # pongs go to the prober's own socket; a stray one here is ignored
        elif kind in ("hello", "ann"):
            body = msg.get("ann")
            try:
                if not isinstance(body, dict):
                    raise ValueError("malformed announcement: 'ann' is not an object")
                ann: Announcement | Exception = Announcement.from_json(body)
            except ValueError as e:
                ann = e
            reason = self._registry.observe(ann, source="unicast", sender=sender, now=now)
            if kind == "hello" and reason is None and isinstance(ann, Announcement):
                self._answer(ann, now)
        else:
            self._malformed(f"unknown message type {str(kind)[:32]!r}", sender, now)

    def _malformed(self, what: str, sender: tuple[str, int], now: float) -> None:
        self._registry.observe(
            ValueError(f"malformed announcement: {what}"), source="unicast", sender=sender, now=now
        )

    def _answer(self, ann: Announcement, now: float) -> None:
        mine = self._announcement()
        if ann.instance == mine.instance or now - self._answered.get(ann.node_id, 0.0) < _ANSWER_EVERY_S:
            return
        if len(self._answered) > 4096:
            self._answered.clear()
        self._answered[ann.node_id] = now
        try:
            self._sock.sendto(self._encode("ann", mine), (ann.address, ann.port))
        except OSError as e:
            log.debug("answer to %s failed: %s", ann.node_id, e)

    def _pong(self, msg: dict[str, object], sender: tuple[str, int], now: float) -> None:
        mine = self._announcement()
        pong = answer_ping(self._key, msg, now, node_id=mine.node_id, instance=mine.instance)
        if pong is None:
            return
        second, count = self._pongs
        if int(now) != second:
            second, count = int(now), 0
        if count >= _MAX_PONGS_PER_S:
            return
        self._pongs = (second, count + 1)
        try:
            self._sock.sendto(json.dumps(pong).encode(), sender)
        except OSError as e:
            log.debug("pong to %s:%s failed: %s", sender[0], sender[1], e)
