"""Link measurement between verified peers: round-trip time over UDP, bandwidth over TCP, both on
the peer's probe port and both authenticated with the pool's discovery key.

Wire format (UDP datagrams are single JSON objects, at most `MAX_DATAGRAM` bytes):

    ping  {"t": "ping", "n": NONCE_HEX, "at": UNIX_S, "to": NODE_ID, "ti": INSTANCE,
           "mac": HEX(HMAC(key, "ping\\0" NONCE AT TO TI))}
    pong  {"t": "pong", "n": NONCE_HEX, "id": NODE_ID, "inst": INSTANCE,
           "mac": HEX(HMAC(key, "pong\\0" NONCE ID INST))}

"to"/"ti" name the node and instance the prober means to reach ("" = any key holder): a responder
that is not that node stays silent, and the pong's MAC covers who answered, so one key holder
cannot answer for another. The prober also takes a pong only from the address and port it pinged.

TCP (same port number): the client sends one line

    {"n": NONCE_HEX, "size": BYTES, "at": UNIX_S, "mac": HEX(HMAC(key, "bw\\0" NONCE SIZE AT))}\\n

and the server answers one line `{"id": NODE_ID, "inst": INSTANCE, "mac": HEX(HMAC(key, "bw-ok\\0"
NONCE SIZE ID INST))}\\n` followed by exactly SIZE bytes; the client times the bytes after that line.
The request line must arrive whole within `REQUEST_DEADLINE_S`, and one source address holds at most
one transfer slot, so a stranger trickling bytes cannot keep members from measuring.

Why authenticated: a planner that splits a model by measured speed must not be steered by an
impostor answering pings fast for a node it is not (the pong's MAC over the prober's fresh nonce
proves the answer came from a key holder), and the probe port must not serve strangers (pings and
transfer requests without a valid MAC, or signed longer than `MAX_SKEW_S` ago, get no answer; a
transfer request's nonce is accepted once; at most `MAX_TRANSFERS` transfers run at a time, each
at most `MAX_TRANSFER_BYTES`). The streamed bytes themselves are not authenticated: an on-path
attacker could slow them, which only makes the pool under-use that link.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping

from computepool.discovery.announce import MAX_SKEW_S

log = logging.getLogger(__name__)

MAX_DATAGRAM = 8192
MAX_TRANSFER_BYTES = 16 << 20
DEFAULT_TRANSFER_BYTES = 2 << 20
MAX_TRANSFERS = 2
REQUEST_DEADLINE_S = 2.0  # the whole transfer request line, however it is trickled
_CHUNK = 64 << 10
_REQUEST_LIMIT = 1024
_SEEN_NONCES = 4096


def _mac(key: bytes, *parts: str | bytes) -> str:
    body = b"\0".join(p.encode() if isinstance(p, str) else p for p in parts)
    return hmac.new(key, body, hashlib.sha256).hexdigest()


# -- UDP ping/pong ----------------------------------------------------------------------------


def ping_message(
    key: bytes, nonce: str, now: float, *, node_id: str = "", instance: str = ""
) -> dict[str, object]:
    """A ping for the node `node_id`/`instance` ("" = whichever key holder answers)."""
    at = repr(now)
    return {
        "t": "ping",
        "n": nonce,
        "at": at,
        "to": node_id,
        "ti": instance,
        "mac": _mac(key, "ping", nonce, at, node_id, instance),
    }


def answer_ping(
    key: bytes, msg: Mapping[str, object], now: float, *, node_id: str = "", instance: str = ""
) -> dict[str, object] | None:
    """The pong of the node `node_id`/`instance` for a genuine, fresh ping addressed to it (or to any
    key holder); None (no answer at all) for anything else."""
    nonce, at, mac = msg.get("n"), msg.get("at"), msg.get("mac")
    to, ti = msg.get("to", ""), msg.get("ti", "")
    if not (
        isinstance(nonce, str)
        and isinstance(at, str)
        and isinstance(mac, str)
        and isinstance(to, str)
        and isinstance(ti, str)
    ):
        return None
    if len(nonce) > 64 or not hmac.compare_digest(_mac(key, "ping", nonce, at, to, ti), mac):
        return None
    if (to and to != node_id) or (ti and ti != instance):
        return None  # meant for another node (or an earlier run of this one)
    try:
        if abs(now - float(at)) > MAX_SKEW_S:
            return None
    except ValueError:
        return None
    return {
        "t": "pong",
        "n": nonce,
        "id": node_id,
        "inst": instance,
        "mac": _mac(key, "pong", nonce, node_id, instance),
    }


def measure_rtt(
    key: bytes,
    local_address: str,
    address: str,
    port: int,
    *,
    count: int = 5,
    timeout_s: float = 1.0,
    node_id: str = "",
    instance: str = "",
) -> float | None:
    """Median round trip in ms of `count` authenticated pings; None when no genuine pong came (from
    `node_id`/`instance` when given) or the peer cannot be reached from `local_address` at all (a
    network error is an unreachable link, never an exception: the prober must outlive bad peers)."""
    rtts: list[float] = []
    try:
        target = _resolve(address, port)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind((local_address, 0))
            for _ in range(count):
                nonce = secrets.token_hex(16)
                sent = time.perf_counter()
                ping = ping_message(key, nonce, time.time(), node_id=node_id, instance=instance)
                sock.sendto(json.dumps(ping).encode(), target)
                deadline = sent + timeout_s
                while (left := deadline - time.perf_counter()) > 0:
                    sock.settimeout(left)
                    try:
                        data, source = sock.recvfrom(MAX_DATAGRAM + 1)
                    except TimeoutError:
                        break
                    if source[:2] == target and _is_pong(key, data, nonce, node_id, instance):
                        rtts.append((time.perf_counter() - sent) * 1000.0)
                        break
    except OSError as e:  # unresolvable, another address family, unroutable from this address …
        log.debug("ping to %s:%s failed: %s", address, port, e)
        return None
    return statistics.median(rtts) if rtts else None


def _resolve(address: str, port: int) -> tuple[str, int]:
    """The IPv4 (address, port) a datagram goes to; OSError when there is none."""
    return (str(socket.getaddrinfo(address, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]), port)


def _is_pong(key: bytes, data: bytes, nonce: str, node_id: str, instance: str) -> bool:
    try:
        msg = json.loads(data)
    except ValueError:
        return False
    if not isinstance(msg, dict) or msg.get("t") != "pong" or msg.get("n") != nonce:
        return False
    who, inst, mac = msg.get("id", ""), msg.get("inst", ""), msg.get("mac")
    if not (isinstance(who, str) and isinstance(inst, str) and isinstance(mac, str)):
        return False
    if (node_id and who != node_id) or (instance and inst != instance):
        return False
    return hmac.compare_digest(_mac(key, "pong", nonce, who, inst), mac)


# -- TCP bandwidth ----------------------------------------------------------------------------


def measure_bandwidth(
    key: bytes,
    local_address: str,
    address: str,
    port: int,
    *,
    size: int = DEFAULT_TRANSFER_BYTES,
    timeout_s: float = 10.0,
    node_id: str = "",
    instance: str = "",
) -> float | None:
    """Mbit/s of one authenticated transfer of `size` bytes from the peer; None when it failed or
    the answer was not the peer's (not `node_id`/`instance`'s, when given)."""
    size = max(1, min(size, MAX_TRANSFER_BYTES))
    nonce, at = secrets.token_hex(16), repr(time.time())
    request = {"n": nonce, "size": size, "at": at, "mac": _mac(key, "bw", nonce, str(size), at)}
    try:
        with socket.create_connection(
            (address, port), timeout=timeout_s, source_address=(local_address, 0)
        ) as s:
            s.sendall(json.dumps(request).encode() + b"\n")
            reader = s.makefile("rb")
            header = reader.readline(_REQUEST_LIMIT)
            try:
                answer = json.loads(header)
                who, inst, mac = str(answer.get("id", "")), str(answer.get("inst", "")), answer.get("mac")
            except (ValueError, AttributeError):
                return None
            if (node_id and who != node_id) or (instance and inst != instance) or not isinstance(mac, str):
                return None
            if not hmac.compare_digest(_mac(key, "bw-ok", nonce, str(size), who, inst), mac):
                return None
            start, got = time.perf_counter(), 0
            while got < size:
                chunk = reader.read1(min(_CHUNK, size - got))
                if not chunk:
                    return None
                got += len(chunk)
            elapsed = max(time.perf_counter() - start, 1e-6)
    except OSError as e:
        log.debug("bandwidth probe to %s:%s failed: %s", address, port, e)
        return None
    return size * 8 / elapsed / 1e6


class BandwidthServer:
    """Answers authenticated transfer requests on a bound, listening TCP socket (one thread, plus one
    per running transfer: at most `MAX_TRANSFERS`, and at most one per source address)."""

    def __init__(
        self,
        key: bytes,
        sock: socket.socket,
        stop: threading.Event,
        *,
        node_id: str = "",
        instance: str = "",
    ) -> None:
        self._key = key
        self._sock = sock
        self._stop = stop
        self._identity = (node_id, instance)
        self._busy: set[str] = set()  # source addresses holding a slot
        self._busy_lock = threading.Lock()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._seen_lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="cpool-discovery-bw", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _serve(self) -> None:
        self._sock.settimeout(0.25)
        while not self._stop.is_set():
            try:
                conn, source = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.1)
                continue
            who = str(source[0])
            with self._busy_lock:
                free = len(self._busy) < MAX_TRANSFERS and who not in self._busy
                if free:
                    self._busy.add(who)
            if not free:
                conn.close()
                continue
            threading.Thread(
                target=self._handle, args=(conn, who), name="cpool-discovery-bw-1", daemon=True
            ).start()

    def _handle(self, conn: socket.socket, who: str) -> None:
        try:
            with conn:
                line = _read_line(conn, time.monotonic() + REQUEST_DEADLINE_S)
                size, nonce = self._check(line) if line is not None else (None, "")
                if size is None:
                    return
                node_id, instance = self._identity
                mac = _mac(self._key, "bw-ok", nonce, str(size), node_id, instance)
                conn.settimeout(5.0)  # a client that stops reading is dropped
                conn.sendall(json.dumps({"id": node_id, "inst": instance, "mac": mac}).encode() + b"\n")
                block = memoryview(bytes(_CHUNK))
                left = size
                while left > 0 and not self._stop.is_set():
                    n = min(left, _CHUNK)
                    conn.sendall(block[:n])
                    left -= n
        except OSError as e:
            log.debug("bandwidth transfer ended: %s", e)
        finally:
            with self._busy_lock:
                self._busy.discard(who)

    def _check(self, line: bytes) -> tuple[int | None, str]:
        try:
            req = json.loads(line)
            nonce, size, at, mac = str(req["n"]), int(req["size"]), str(req["at"]), str(req["mac"])
            fresh = abs(time.time() - float(at)) <= MAX_SKEW_S
        except (ValueError, KeyError, TypeError):
            return None, ""
        if not (0 < size <= MAX_TRANSFER_BYTES and fresh and len(nonce) <= 64):
            return None, ""
        if not hmac.compare_digest(_mac(self._key, "bw", nonce, str(size), at), mac):
            return None, ""
        with self._seen_lock:
            if nonce in self._seen:
                return None, ""  # a replayed request
            self._seen[nonce] = None
            while len(self._seen) > _SEEN_NONCES:
                self._seen.popitem(last=False)
        return size, nonce


def _read_line(conn: socket.socket, deadline: float) -> bytes | None:
    """The first line, if it arrives whole (≤ `_REQUEST_LIMIT` bytes) before `deadline` (monotonic);
    None otherwise. One deadline for the whole line, not per read: a trickle cannot stretch it."""
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if len(buf) > _REQUEST_LIMIT or left <= 0:
            return None
        conn.settimeout(left)
        try:
            chunk = conn.recv(_REQUEST_LIMIT)
        except TimeoutError:
            return None
        if not chunk:
            return None
        buf += chunk
    return buf.split(b"\n", 1)[0]
