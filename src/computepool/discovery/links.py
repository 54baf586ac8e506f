"""Link measurement between verified peers: round-trip time over UDP, bandwidth over TCP, both on
the peer's probe port and both authenticated with the pool's discovery key.

Wire format (UDP datagrams are single JSON objects, at most `MAX_DATAGRAM` bytes):

    ping  {"t": "ping", "n": NONCE_HEX, "at": UNIX_S, "mac": HEX(HMAC(key, "ping\\0" NONCE AT))}
    pong  {"t": "pong", "n": NONCE_HEX, "mac": HEX(HMAC(key, "pong\\0" NONCE))}

TCP (same port number): the client sends one line

    {"n": NONCE_HEX, "size": BYTES, "at": UNIX_S, "mac": HEX(HMAC(key, "bw\\0" NONCE SIZE AT))}\\n

and the server answers one line `{"mac": HEX(HMAC(key, "bw-ok\\0" NONCE SIZE))}\\n` followed by
exactly SIZE bytes; the client times the bytes after that line.

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
_CHUNK = 64 << 10
_REQUEST_LIMIT = 1024
_SEEN_NONCES = 4096


def _mac(key: bytes, *parts: str | bytes) -> str:
    body = b"\0".join(p.encode() if isinstance(p, str) else p for p in parts)
    return hmac.new(key, body, hashlib.sha256).hexdigest()


# -- UDP ping/pong ----------------------------------------------------------------------------


def ping_message(key: bytes, nonce: str, now: float) -> dict[str, object]:
    at = repr(now)
    return {"t": "ping", "n": nonce, "at": at, "mac": _mac(key, "ping", nonce, at)}


def answer_ping(key: bytes, msg: Mapping[str, object], now: float) -> dict[str, object] | None:
    """The pong for a genuine, fresh ping; None (no answer at all) for anything else."""
    nonce, at, mac = msg.get("n"), msg.get("at"), msg.get("mac")
    if not (isinstance(nonce, str) and isinstance(at, str) and isinstance(mac, str)) or len(nonce) > 64:
        return None
    if not hmac.compare_digest(_mac(key, "ping", nonce, at), mac):
        return None
    try:
        if abs(now - float(at)) > MAX_SKEW_S:
            return None
    except ValueError:
        return None
    return {"t": "pong", "n": nonce, "mac": _mac(key, "pong", nonce)}


def measure_rtt(
    key: bytes, local_address: str, address: str, port: int, *, count: int = 5, timeout_s: float = 1.0
) -> float | None:
    """Median round trip in ms of `count` authenticated pings; None when no genuine pong came."""
    rtts: list[float] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((local_address, 0))
        sock.settimeout(timeout_s)
        for _ in range(count):
            nonce = secrets.token_hex(16)
            sent = time.perf_counter()
            sock.sendto(json.dumps(ping_message(key, nonce, time.time())).encode(), (address, port))
            deadline = sent + timeout_s
            while (left := deadline - time.perf_counter()) > 0:
                sock.settimeout(left)
                try:
                    data, _ = sock.recvfrom(MAX_DATAGRAM + 1)
                except TimeoutError:
                    break
                if _is_pong(key, data, nonce):
                    rtts.append((time.perf_counter() - sent) * 1000.0)
                    break
    return statistics.median(rtts) if rtts else None


def _is_pong(key: bytes, data: bytes, nonce: str) -> bool:
    try:
        msg = json.loads(data)
    except ValueError:
        return False
    return (
        isinstance(msg, dict)
        and msg.get("t") == "pong"
        and msg.get("n") == nonce
        and isinstance(msg.get("mac"), str)
        and hmac.compare_digest(_mac(key, "pong", nonce), msg["mac"])
    )


# -- TCP bandwidth ----------------------------------------------------------------------------


def measure_bandwidth(
    key: bytes,
    local_address: str,
    address: str,
    port: int,
    *,
    size: int = DEFAULT_TRANSFER_BYTES,
    timeout_s: float = 10.0,
) -> float | None:
    """Mbit/s of one authenticated transfer of `size` bytes from the peer; None when it failed or
    the answer was not the peer's."""
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
                mac = json.loads(header).get("mac")
            except (ValueError, AttributeError):
                return None
            if not isinstance(mac, str) or not hmac.compare_digest(_mac(key, "bw-ok", nonce, str(size)), mac):
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
    per running transfer, at most `MAX_TRANSFERS`)."""

    def __init__(self, key: bytes, sock: socket.socket, stop: threading.Event) -> None:
        self._key = key
        self._sock = sock
        self._stop = stop
        self._slots = threading.BoundedSemaphore(MAX_TRANSFERS)
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
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.1)
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(
                target=self._handle, args=(conn,), name="cpool-discovery-bw-1", daemon=True
            ).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(5.0)
                line = _read_line(conn)
                size, nonce = self._check(line) if line is not None else (None, "")
                if size is None:
                    return
                conn.sendall(json.dumps({"mac": _mac(self._key, "bw-ok", nonce, str(size))}).encode() + b"\n")
                block = memoryview(bytes(_CHUNK))
                left = size
                while left > 0 and not self._stop.is_set():
                    n = min(left, _CHUNK)
                    conn.sendall(block[:n])
                    left -= n
        except OSError as e:
            log.debug("bandwidth transfer ended: %s", e)
        finally:
            self._slots.release()

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


def _read_line(conn: socket.socket) -> bytes | None:
    buf = b""
    while b"\n" not in buf:
        if len(buf) > _REQUEST_LIMIT:
            return None
        chunk = conn.recv(_REQUEST_LIMIT)  # the 5 s timeout raises (an OSError) on a silent client
        if not chunk:
            return None
        buf += chunk
    return buf.split(b"\n", 1)[0]
