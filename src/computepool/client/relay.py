"""The user's side of relay sessions: ask the pool for one (POST), then open its WebSocket on the
replica that answered, with the same token and CA as every other call (wire/relay.py's frames).

`run_exec` passes this terminal's (or pipe's) bytes to a command in a job and returns its exit
status; `Forwarder` listens on this machine and tunnels each connection to a port in a job.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import sys
import termios
import threading
import tty
from collections.abc import Callable
from pathlib import Path
from typing import Any

from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.sync.client import ClientConnection, connect

from computepool.client.errors import PoolError, ServerUnreachable
from computepool.client.http import PoolClient
from computepool.core.tls import client_context
from computepool.wire.relay import CLIENT_SECRET_HEADER, DATA, STDERR, STDIN, STDOUT

CHUNK = 64 * 1024


def ws_url(http_url: str, sid: int) -> str:
    base = http_url.rstrip("/")
    base = "wss://" + base[8:] if base.startswith("https://") else "ws://" + base.removeprefix("http://")
    return f"{base}/api/v1/relays/{sid}/client"


class Session:
    """One relay session of `pool`'s caller into allocation `alloc`."""

    def __init__(self, pool: PoolClient, ca: str | None, alloc: str, body: dict[str, Any]) -> None:
        out = pool.request("POST", f"/allocations/{alloc}/relays", json=body)
        self.info = out
        url = ws_url(out.get("url") or pool.server, int(out["id"]))
        verify = client_context(Path(ca)) if ca and url.startswith("wss://") else None
        ctx = verify if isinstance(verify, ssl.SSLContext) else None
        headers = {CLIENT_SECRET_HEADER: str(out["secret"])}
        if pool.token:
            headers["Authorization"] = f"Bearer {pool.token}"
        try:
            self.ws: ClientConnection = connect(
                url,
                additional_headers=headers,
                ssl=ctx,
                open_timeout=15,
                compression=None,
                max_size=4 * CHUNK,
            )
        except (OSError, InvalidHandshake, TimeoutError) as e:
            raise ServerUnreachable(url, f"cannot open the session's socket: {e}", tls=True) from None
        self._lock = threading.Lock()

    def send(self, frame: bytes | str) -> bool:
        with self._lock:
            try:
                self.ws.send(frame)
                return True
            except (ConnectionClosed, OSError):
                return False

    def control(self, frame: str) -> dict[str, Any]:
        """A text frame from the node or server; an {"error"} one is raised as PoolError."""
        msg = json.loads(frame)
        if isinstance(msg, dict) and "error" in msg:
            raise PoolError(int(msg.get("status") or 502), str(msg["error"]))
        return msg if isinstance(msg, dict) else {}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()


def _terminal_size() -> tuple[int, int]:
    try:
        size = os.get_terminal_size(sys.stdout.fileno())
        return size.lines, size.columns
    except (OSError, ValueError):
        return 24, 80


def run_exec(
    pool: PoolClient, ca: str | None, alloc: str, command: list[str], rank: int, pty: bool,
    write: Callable[[int, bytes], None] | None = None,
) -> int:  # fmt: skip
    """Run `command` in the job; this process's stdin goes to it, its output comes here (to
    `write(1 or 2, bytes)` when given). Its exit status (128+N when killed by signal N); a session
    that ends without one raises PoolError."""
    rows, cols = _terminal_size()
    body = {"kind": "exec", "command": command, "rank": rank, "tty": pty, "rows": rows, "cols": cols}
    s = Session(pool, ca, alloc, body)
    stdin = sys.stdin.fileno()
    raw = pty and os.isatty(stdin)
    saved = termios.tcgetattr(stdin) if raw else None
    resized = threading.Event()
    old_winch: Any = None
    if pty:
        old_winch = signal.signal(signal.SIGWINCH, lambda *_: resized.set())
    try:
        if saved is not None:
            # Ctrl-C, Ctrl-Z and the rest go to the job's terminal as bytes; keys typed ahead are kept
            tty.setraw(stdin, termios.TCSANOW)
        threading.Thread(target=_stdin_pump, args=(s, stdin), daemon=True).start()
        return _receive(s, resized, write or _write_all)
    finally:
        if saved is not None:
            termios.tcsetattr(stdin, termios.TCSADRAIN, saved)
        if pty:
            signal.signal(signal.SIGWINCH, old_winch)
        s.close()


def _stdin_pump(s: Session, fd: int) -> None:
    while True:
        try:
            data = os.read(fd, CHUNK)
        except OSError:
            data = b""
        if not data:
            s.send(json.dumps({"eof": True}))
            return
        if not s.send(bytes([STDIN]) + data):
            return


def _receive(s: Session, resized: threading.Event, write: Callable[[int, bytes], None]) -> int:
    while True:
        if resized.is_set():
            resized.clear()
            s.send(json.dumps({"resize": list(_terminal_size())}))
        try:
            frame = s.ws.recv(timeout=0.2)
        except TimeoutError:
            continue
        except ConnectionClosed:
            raise PoolError(502, "the session closed before the command ended") from None
        if isinstance(frame, bytes):
            out = 2 if frame[:1] == bytes([STDERR]) else 1 if frame[:1] == bytes([STDOUT]) else None
            if out is not None:
                write(out, frame[1:])
            continue
        msg = s.control(frame)
        if "exit" in msg:
            return int(msg["exit"])


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Forwarder:
    """Listens on 127.0.0.1:`local`; each connection becomes a session to `port` in the job."""

    def __init__(
        self, pool: PoolClient, ca: str | None, alloc: str, port: int, rank: int, local: int,
        say: Callable[[str], None],
    ) -> None:  # fmt: skip
        self.pool, self.ca, self.alloc, self.port, self.rank, self.say = pool, ca, alloc, port, rank, say
        body = {"kind": "forward", "port": port, "rank": rank, "check": True}
        pool.request("POST", f"/allocations/{alloc}/relays", json=body)  # bad input: said before listening
        self.listener = socket.create_server(("127.0.0.1", local))
        self.local = self.listener.getsockname()[1]

    def serve(self) -> None:
        with self.listener:
            while True:
                conn, _ = self.listener.accept()
                threading.Thread(target=self._tunnel, args=(conn,), daemon=True).start()

    def _tunnel(self, conn: socket.socket) -> None:
        with conn:
            try:
                s = Session(
                    self.pool, self.ca, self.alloc, {"kind": "forward", "port": self.port, "rank": self.rank}
                )
            except (PoolError, ServerUnreachable) as e:
                self.say(f"connection refused: {e}")
                return
            threading.Thread(target=_socket_to_session, args=(conn, s), daemon=True).start()
            try:
                while True:
                    frame = s.ws.recv()
                    if isinstance(frame, bytes):
                        if frame[:1] == bytes([DATA]):
                            conn.sendall(frame[1:])
                    else:
                        s.control(frame)
            except PoolError as e:
                self.say(f"connection to port {self.port} failed: {e.message}")
            except (ConnectionClosed, OSError):
                pass
            finally:
                s.close()
                with contextlib.suppress(OSError):  # wakes the reader: the connection ends here too
                    conn.shutdown(socket.SHUT_RDWR)


def _socket_to_session(conn: socket.socket, s: Session) -> None:
    while True:
        try:
            data = conn.recv(CHUNK)
        except OSError:
            data = b""
        if not data:
            s.send(json.dumps({"eof": True}))
            return
        if not s.send(bytes([DATA]) + data):
            return
