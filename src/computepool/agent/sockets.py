"""A job's sockets as the root agent can see them: which descriptors are sockets, which sockets the
kernel's /proc/net tables list, and the local port of one no table lists.

A TCP socket that is bound but neither listening nor connected holds its port against every later
bind, yet no /proc/net table lists it (the kernel's tables hold listening and connected sockets).
Its port can only be read from the socket itself: the agent copies the job's descriptor into its
own process with pidfd_getfd(2) (Linux 5.6; root passes its ptrace check), asks the copy for its
address, and closes the copy — the job's socket is untouched.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import platform
import socket
from pathlib import Path

# pidfd_getfd(2): 438 on every architecture with the unified syscall table (x86_64, aarch64, …)
SYS_PIDFD_GETFD = 438
TABLES = ("tcp", "tcp6", "udp", "udp6", "udplite", "udplite6", "raw", "raw6", "unix", "packet", "netlink")
_INODE_COLUMN = {"unix": 6, "packet": 8, "netlink": 8}  # tcp/udp/raw: column 9


def socket_fds(pid: int, proc: Path = Path("/proc")) -> dict[int, int]:
    """Socket inode → one descriptor of process `pid` that holds it (empty if gone or unreadable)."""
    fd_dir = proc / str(pid) / "fd"
    out: dict[int, int] = {}
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if target.startswith("socket:[") and name.isdigit():
            with contextlib.suppress(ValueError):
                out.setdefault(int(target[8:-1]), int(name))
    return out


def tabled_sockets(proc: Path = Path("/proc")) -> set[int]:
    """Inodes of every socket some /proc/net table lists, in the reader's network namespace."""
    found: set[int] = set()
    for name in TABLES:
        column = _INODE_COLUMN.get(name, 9)
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > column and f[column].isdigit():
                found.add(int(f[column]))
    return found


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    got = int(libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0))
    if got < 0:
        raise OSError(ctypes.get_errno(), "pidfd_getfd")
    return got


def bound_port(pid: int, fd: int) -> int | None:
    """The local port of process `pid`'s descriptor `fd` when it is a bound TCP socket (IPv4 or
    IPv6), else None (not TCP, not bound, the process gone, or no pidfd_getfd here)."""
    if platform.system() != "Linux":
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        copy = _pidfd_getfd(pidfd, fd)
    except OSError:
        return None
    finally:
        os.close(pidfd)
    try:
        s = socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        return None
    try:
        if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
            return None
        if not _in_our_network(s):  # a job's own network namespace: its ports are not the node's
            return None
        port = int(s.getsockname()[1])
        return port or None
    except OSError:
        return None
    finally:
        s.close()  # the copy only: the job's descriptor and its socket stay as they were


SIOCGSKNS = 0x894C  # linux/sockios.h: a descriptor of the socket's network namespace


def _in_our_network(s: socket.socket) -> bool:
    """Whether `s` belongs to this process's network namespace (True when that cannot be told)."""
    try:
        ns = fcntl.ioctl(s.fileno(), SIOCGSKNS)
    except OSError:
        return True
    try:
        return os.fstat(ns).st_ino == os.stat("/proc/self/ns/net").st_ino
    finally:
        os.close(ns)
