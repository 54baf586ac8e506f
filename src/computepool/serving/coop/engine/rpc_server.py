"""llama.cpp's RPC server on this node's CPU, for layers of a model split over several nodes.

Run by an allocation as `PYTHON -c LOADER RELAY <this source> --host IP --port N [--threads N]`
(scripts.command) with the llama venv's python: stdlib and llama_cpp only, since computepool is not
installed there. llama.cpp's RPC protocol has no authentication (whoever reaches it can read and
write this process's memory), so llama.cpp never listens where anything else can reach it:

- this program first binds the node's listening socket on (host, port) itself, and only on a
  loopback, RFC 1918, RFC 6598 or link-local IPv4 address (a wildcard or public one: exit 2);
- then, still single-threaded, it enters a new user and network namespace of its own and starts
  llama.cpp's server on 127.0.0.1 in there: no other process can connect to it. If the namespace
  cannot be made, it exits 2 rather than expose llama.cpp;
- a relay (relay.py) accepts on the node's socket, which keeps working across the unshare, and
  carries only clients that prove the plan's secret (CPOOL_COOP_SECRET) to llama.cpp. Authenticated,
  not encrypted.

Prints `CPOOL-RPC ready HOST:PORT` once llama.cpp answers inside; SIGTERM ends it with exit 0.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import importlib
import ipaddress
import os
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # at run time the loader has run relay.py in this namespace already
    from .relay import coop_secret, serve_relay

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1

PRIVATE = tuple(
    ipaddress.ip_network(n)
    for n in ("127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
              "169.254.0.0/16", "::1/128", "fc00::/7", "fe80::/10")
)  # fmt: skip


def say(line: str, fd: int = 1) -> None:
    """One whole line in one write (llama.cpp writes to stderr too)."""
    os.write(fd, (line + "\n").encode())


def refusal(host: str) -> str | None:
    """Why `host` must not be listened on, or None."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"--host {host!r} is not an IP address"
    if not any(ip in net for net in PRIVATE):
        return (f"--host {host} is not a private, loopback or link-local address: llama.cpp's RPC has "
                "no authentication and must never listen on an open port")  # fmt: skip
    if ip.version != 4:
        return f"--host {host}: llama.cpp's RPC server listens on IPv4 addresses only"
    return None


def isolate() -> None:
    """Enter a network namespace of this process's own, with only its loopback up; OSError if not.
    Needs a single-threaded process (the kernel refuses a new user namespace otherwise)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH22x", b"lo", 0))[:18])[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def serve(host: str, port: int, threads: int) -> None:
    """Blocks in llama.cpp's accept loop (one client at a time); returns only if it cannot listen."""
    # imported by name: the llama venv has llama_cpp, the package's own checkers do not
    lib = Path(importlib.import_module("llama_cpp").__file__ or "").parent / "lib"
    ggml = ctypes.CDLL(str(lib / "libggml.so"), mode=ctypes.RTLD_GLOBAL)
    rpc = ctypes.CDLL(str(lib / "libggml-rpc.so"), mode=ctypes.RTLD_GLOBAL)
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    cpu = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not cpu:
        return
    rpc.ggml_backend_rpc_start_server.argtypes = [
        ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p,
    ]  # fmt: skip
    devices = (ctypes.c_void_p * 1)(cpu)
    rpc.ggml_backend_rpc_start_server(f"{host}:{port}".encode(), None, threads, 1, devices)


def main() -> None:
    p = argparse.ArgumentParser(prog="rpc_server", description="llama.cpp RPC server on a private address")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ready-timeout", type=float, default=60.0)
    a = p.parse_args()
    why = refusal(a.host)
    if why is None and not 0 < a.port < 65536:
        why = f"--port {a.port} is not a TCP port"
    if why is None and a.threads < 1:
        why = "--threads must be at least 1"
    if why is None:
        try:
            secret = coop_secret()
        except ValueError as e:
            why = str(e)
    if why:
        say(f"rpc_server: {why}", 2)
        sys.exit(2)

    out = os.dup(1)  # stdout carries only this program's lines: llama.cpp's own printing goes to stderr
    os.dup2(2, 1)

    def stop(signum: int, _frame: FrameType | None) -> None:
        say(f"CPOOL-RPC stopped by signal {signum}", out)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    listener = socket.socket()  # ours before anything else runs: nobody can take the port in between
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((a.host, a.port))
        listener.listen(16)
    except OSError as e:
        say(f"rpc_server: cannot listen on {a.host}:{a.port}: {e.strerror or e}", 2)
        sys.exit(1)
    try:
        isolate()
    except OSError as e:
        say(f"rpc_server: cannot give llama.cpp a private network namespace ({e.strerror or e}); "
            "refusing to expose its unauthenticated RPC", 2)  # fmt: skip
        sys.exit(2)
    with socket.socket() as s:  # a free port of the private loopback: nothing else lives there
        s.bind(("127.0.0.1", 0))
        inner = ("127.0.0.1", int(s.getsockname()[1]))
    # llama.cpp's loop never returns to Python: it runs in a thread, this one waits for signals
    server = threading.Thread(target=serve, args=(*inner, a.threads), daemon=True)
    server.start()
    deadline = time.monotonic() + a.ready_timeout
    while True:
        try:
            socket.create_connection(inner, timeout=5.0).close()  # llama.cpp drops it
            break
        except OSError as e:
            if not server.is_alive() or time.monotonic() > deadline:
                say(f"rpc_server: llama.cpp did not start serving: {e}", 2)
                sys.exit(1)
            time.sleep(0.05)
    threading.Thread(target=serve_relay, args=(listener, secret, inner), daemon=True).start()
    say(f"CPOOL-RPC ready {a.host}:{a.port}", out)
    while server.is_alive():
        server.join(0.5)
    say(f"rpc_server: llama.cpp stopped serving on {a.host}:{a.port}", 2)
    sys.exit(1)


if __name__ == "__main__":
    main()
