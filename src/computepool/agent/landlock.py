"""Landlock scopes for process jobs: a job may connect to no abstract unix socket and signal no
process outside its own Landlock domain.

Abstract unix sockets (a name starting with a NUL byte) have no file and so no mode: any process
in the same network namespace may connect to one, whoever made it (debuggers, X11, D-Bus, NCCL and
many servers listen on them). A job that keeps the node's network would otherwise reach every
other job's and every host daemon's. Since Linux 6.12 (Landlock ABI 6) a process can put itself in
a domain that is *scoped*: connecting to an abstract socket made outside the domain (or inside a
domain that is not its own or nested in it) fails with EPERM, and so does sending a signal to a
process outside it. Processes outside the domain keep reaching in: the agent still signals the
job, and a job still connects to another job's socket only if that job lets the world in through a
path (where file modes decide).

The ruleset handles no file system or network access: scopes alone. Each job's first step (the
root-side launcher, before the namespaces are made) restricts itself, so the whole job, its
namespaces' init and everything it forks share one domain of its own.

Only the standard library: this runs in the job's launcher (`python -I`), ahead of everything else.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Sequence

SYS_CREATE_RULESET, SYS_RESTRICT_SELF = 444, 446  # the same numbers on every architecture
CREATE_RULESET_VERSION = 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2
SCOPES_ABI = 6  # the first ABI with scopes
PR_SET_NO_NEW_PRIVS = 38
SUMMARY = "landlock: no abstract unix socket or signal outside the job"


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def abi() -> int:
    """The kernel's Landlock ABI version; 0 where Landlock is missing or turned off."""
    if platform.system() != "Linux":
        return 0
    v = int(
        _libc().syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    )
    return max(v, 0)


def probe() -> str:
    """ "" where scopes can be applied here, else why not (in words, for the job's limits)."""
    v = abi()
    if v == 0:
        return "this kernel has no Landlock (or it is turned off: lsm=)"
    if v < SCOPES_ABI:
        return f"this kernel's Landlock (ABI {v}) has no scopes (ABI {SCOPES_ABI}, Linux 6.12)"
    return ""


def restrict_scopes(scoped: int = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) -> None:
    """Put this process (and all it will run) in a new domain with these scopes (by default for
    abstract unix sockets and signals). Sets no_new_privs first (Landlock needs it, or
    CAP_SYS_ADMIN). Raises OSError."""
    libc = _libc()
    attr = _RulesetAttr(0, 0, scoped)
    fd = int(libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), 0))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_create_ruleset: {os.strerror(err)}")
    try:
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
        if libc.syscall(SYS_RESTRICT_SELF, fd, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_restrict_self: {os.strerror(err)}")
    finally:
        os.close(fd)


def main(argv: Sequence[str]) -> int:
    """`python -I -c <this file> -- ARGV`: ARGV in a new domain scoped for abstract unix sockets
    alone (jobexec.py: a command exec'd into a job that keeps the node's network). Never runs ARGV
    unscoped."""
    if len(argv) < 2 or argv[0] != "--":
        print("usage: python -I -c <landlock.py> -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    try:
        restrict_scopes(SCOPE_ABSTRACT_UNIX_SOCKET)
    except OSError as e:
        print(f"cpool: cannot scope the command: {e}", file=sys.stderr)
        return 126
    try:
        os.execvp(argv[1], list(argv[1:]))
    except OSError as e:
        print(f"cpool: cannot run {argv[1]}: {e.strerror or e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
