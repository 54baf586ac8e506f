"""Authenticated relays in front of llama.cpp's RPC protocol, shared by the engine's programs.

llama.cpp's RPC has no authentication: whoever reaches an RPC server can read and write its tensors.
So no llama.cpp socket is ever reachable from the network: the RPC server listens only inside its own
private network namespace and the head's llama.cpp talks only to relays on 127.0.0.1 of its own
process. Every TCP connection between the two relays starts with a challenge-response over the plan's
secret (CPOOL_COOP_SECRET, 64 hex digits, read from the environment only, never printed): the server
sends a nonce, the client answers with its own nonce and an HMAC over both, and the server proves
itself back with an HMAC in the other direction, so neither side talks to an impostor. Only then are
llama.cpp's bytes carried, unchanged. Authenticated, NOT encrypted: a host on the path can read them,
which is why the addresses stay private-only.

Travels as the first of two sources (`scripts.command`), run in the program's own namespace: stdlib
only, and no dataclasses (the compactor drops the annotations they need).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import threading
import time
from collections.abc import Callable

SECRET_ENV = "CPOOL_COOP_SECRET"
TAG = b"coop rpc v1"
NONCE = 16
MAC = 32
HANDSHAKE_S = 5.0  # a client that has not proven itself by then is dropped
MAX_HANDSHAKES = 8  # unauthenticated connections held at once (each at most HANDSHAKE_S)
MAX_CARRIED = 4  # authenticated connections carried at once
CHUNK = 1 << 16
LOST_TEXT = "connection closed or timed out"


def coop_secret() -> bytes:
    """The plan's secret from the environment; ValueError (without the value) when absent or malformed."""
    text = os.environ.get(SECRET_ENV, "")
    if not text:
        raise ValueError(f"{SECRET_ENV} is not set: the RPC connections cannot be authenticated")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ValueError(f"{SECRET_ENV} must be 64 hexadecimal digits (32 bytes)")
    return key


def mac(secret: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The proof of `side` (b"c" client, b"s" server): distinct, so neither can be reflected back."""
    return hmac.new(secret, TAG + b"|" + side + b"|" + server_nonce + client_nonce, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly n bytes before `deadline` (monotonic), or ConnectionError."""
    got = b""
    while len(got) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConnectionError("timed out")
        sock.settimeout(left)
        part = sock.recv(n - len(got))
        if not part:
            raise ConnectionError("closed")
        got += part
    sock.settimeout(None)
    return got


def server_handshake(conn: socket.socket, secret: bytes) -> bool:
    """Whether the client proved the secret (then this side has proven it back)."""
    deadline = time.monotonic() + HANDSHAKE_S
    nonce = os.urandom(NONCE)
    conn.settimeout(HANDSHAKE_S)
    conn.sendall(nonce)
    answer = recv_exact(conn, NONCE + MAC, deadline)
    theirs, proof = answer[:NONCE], answer[NONCE:]
    if not hmac.compare_digest(proof, mac(secret, b"c", nonce, theirs)):
        return False
    conn.sendall(mac(secret, b"s", nonce, theirs))
    return True


def client_handshake(sock: socket.socket, secret: bytes) -> str | None:
    """Why the server is not to be trusted, or None once both sides have proven the secret."""
    deadline = time.monotonic() + HANDSHAKE_S
    try:
        nonce = recv_exact(sock, NONCE, deadline)
        mine = os.urandom(NONCE)
        sock.sendall(mine + mac(secret, b"c", nonce, mine))
        proof = recv_exact(sock, MAC, deadline)
    except OSError as e:
        return f"it did not accept the pool's secret ({e})"
    if not hmac.compare_digest(proof, mac(secret, b"s", nonce, mine)):
        return "it could not prove it holds the pool's secret"
    return None


def carry(local: socket.socket, remote: socket.socket, lost: Callable[[], None] | None = None) -> None:
    """Copies bytes both ways until either side ends, then closes both. `lost()` runs when the remote
    side ended first (before anything is closed: the caller may end the process there)."""
    ended: list[socket.socket] = []
    lock = threading.Lock()
    for s in (local, remote):  # RPC is many small round trips: never wait to coalesce them
        with contextlib.suppress(OSError):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def end(side: socket.socket) -> None:
        with lock:
            first = not ended
            ended.append(side)
        if first and side is remote and lost is not None:
            lost()
        for s in (local, remote):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def copy(src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(CHUNK)
            except OSError:
                data = b""
            if not data:
                return end(src)
            try:
                dst.sendall(data)
            except OSError:
                return end(dst)

    back = threading.Thread(target=copy, args=(remote, local), daemon=True)
    back.start()
    copy(local, remote)
    back.join()
    local.close()
    remote.close()


def accept(listener: socket.socket) -> tuple[socket.socket, tuple[str, int]]:
    """The next connection; a failed accept (out of descriptors, an aborted connection) is retried."""
    while True:
        try:
            conn, peer = listener.accept()
            return conn, peer
        except OSError:
            time.sleep(0.1)


def serve_relay(listener: socket.socket, secret: bytes, inner: tuple[str, int]) -> None:
    """The RPC server's side: accepts on `listener`, and carries each client that proves the secret to
    llama.cpp at `inner`. Bounded; failures close the connection and nothing more."""
    handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
    carried = threading.BoundedSemaphore(MAX_CARRIED)

    def one(conn: socket.socket) -> None:
        try:
            keep_alive(conn)
            ok = server_handshake(conn, secret)
        except OSError:
            ok = False
        finally:
            handshakes.release()
        if not ok or not carried.acquire(blocking=False):
            conn.close()
            return
        try:
            up = socket.create_connection(inner, timeout=10.0)
            up.settimeout(None)
            carry(conn, up)
        except OSError:
            conn.close()
        finally:
            carried.release()

    while True:
        conn = accept(listener)[0]
        if handshakes.acquire(blocking=False):
            threading.Thread(target=one, args=(conn,), daemon=True).start()
        else:
            conn.close()


def own_client(peer: tuple[str, int], listening: tuple[str, int]) -> bool:
    """Whether the connection from `peer` to `listening` was opened by this very process: one of its
    own descriptors is that connection's other end. Asked of each descriptor (through a duplicate),
    not read from /proc/net/tcp, whose rows can go missing while other sockets come and go."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            if not link.startswith("socket:["):
                continue
            with socket.socket(fileno=os.dup(int(fd))) as s:
                if s.family == socket.AF_INET and s.getsockname() == peer and s.getpeername() == listening:
                    return True
        except OSError:  # closed meanwhile, or not connected: not this one
            continue
    return False


def keep_alive(sock: socket.socket) -> None:
    """Keepalives and a bound on unacknowledged sends: a peer that vanished without closing becomes an
    error within ~25 s instead of holding the connection (and llama.cpp's one client slot) forever."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 20_000)


def dial(endpoint: str, secret: bytes) -> tuple[socket.socket | None, str]:
    """An authenticated connection to the RPC server at `endpoint`, or None and why not."""
    host, _, port = endpoint.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=10.0)
        keep_alive(sock)
    except OSError as e:
        return None, f"cannot connect to the RPC server {endpoint}: {e.strerror or e}"
    why = client_handshake(sock, secret)
    if why:
        sock.close()
        return None, f"cannot connect to the RPC server {endpoint}: {why}"
    return sock, ""


def local_relays(endpoints: list[str], secret: bytes, lost: Callable[[str], None]) -> list[str]:
    """For each remote RPC server, a listener on 127.0.0.1 that only this process may use; each of
    its connections is carried over a fresh authenticated one. `lost(message)` runs when a server
    cannot be reached or ends a connection first. Returns the listeners' ADDRESS:PORT, in order."""

    def one(conn: socket.socket, endpoint: str) -> None:
        up, why = dial(endpoint, secret)
        if up is None:
            lost(why)
            conn.close()
            return
        carry(conn, up, lambda: lost(f"lost the RPC server {endpoint}: {LOST_TEXT}"))

    def serve(listener: socket.socket, endpoint: str) -> None:
        here = listener.getsockname()
        while True:
            conn, peer = accept(listener)
            try:
                ours = own_client(peer, here)
            except OSError:
                ours = False
            if ours:
                threading.Thread(target=one, args=(conn, endpoint), daemon=True).start()
            else:
                conn.close()

    found: list[str] = []
    for endpoint in endpoints:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        threading.Thread(target=serve, args=(listener, endpoint), daemon=True).start()
        found.append(f"127.0.0.1:{listener.getsockname()[1]}")
    return found
