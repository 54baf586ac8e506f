"""What `cpool exec` and `cpool forward` run on the node: a command inside a running process job's
sandbox, and a TCP connection made from inside the job's network namespace.

A process job runs under an init shell that is PID 1 of the job's PID namespace (sandbox.py); it
holds the job's mount, UTS, IPC and network namespaces too. An exec'd command joins them all with
`nsenter --target <that pid>`, joins the job's cgroups first (so it counts in the job's CPU,
memory and process limits), loads the job's syscall filter (after nsenter, which needs setns the
filter refuses) and drops to the tenant's user with `setpriv` exactly as the job did: no
capabilities, no supplementary groups, no_new_privs. Its environment is the job's (read from the
job's first process of the tenant, carried past the root steps as one inert value, as the job's
was), its directory the job's work dir. In a job with a network of its own it gets no Landlock
domain: it would cut the shell off from signalling (and tracing) the job's own processes, and the
job's PID and network namespaces already confine what a signal or an abstract socket could reach.
A job that keeps the node's network (a gang member, a replica) shares the node's abstract unix
sockets, which its own Landlock scope keeps it from: there the exec'd command gets a domain of its
own scoped for abstract sockets (not signals: its PID namespace holds those), made after nsenter
(a domain cannot open another's namespaces); it then cannot trace the job's processes either.

The namespaces are never named by pid at the moment of use: a job that ends frees its init's pid,
and another tenant's next process may take it. The agent opens a pidfd for the init first, checks
that this pid is still a process of the job (a descendant of its leader, or the container's
process as the engine reports it), opens the namespace files, and checks through the pidfd that
the process has not exited since (while it lives its pid names no one else). The open files are
what nsenter (by /proc/<agent>/fd/N) and setns use.

A forwarded connection is made by a short-lived thread of the agent that switches to the job's
network namespace (setns is per thread), connects to 127.0.0.1:PORT there, and switches back: the
socket stays in the job's namespace. A job that shares the node's network (gang members, jobs
given ports, or a node without slirp4netns) has no loopback of its own: forwarding to it would
reach the node's own services, so it is refused.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import pwd
import select
import shlex
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from computepool.agent import landlock, syscall_filter
from computepool.agent.localstate import JobRecord
from computepool.agent.sandbox import FIXED_PATH, HANDOVER, HostSupport, root_side_env

CLONE_NEWNET = 0x40000000
EXEC_NAMESPACES = ("mnt", "uts", "ipc", "net", "pid")  # /proc/PID/ns names, nsenter's options below
_NSENTER = {"mnt": "--mount", "uts": "--uts", "ipc": "--ipc", "net": "--net", "pid": "--pid"}
_RLIMITS = (("as", psutil.RLIMIT_AS), ("nproc", psutil.RLIMIT_NPROC))
CONNECT_TIMEOUT_S = 5.0
# Runs as root: joins the job's cgroups ($1, newline-separated) and execs the rest.
_JOIN_CGROUPS = """\
_cpool_cgs=$1
shift
_cpool_ifs=$IFS
IFS='
'
for _cpool_cg in $_cpool_cgs; do
    [ -n "$_cpool_cg" ] && { echo $$ > "$_cpool_cg/cgroup.procs" || exit 126; }
done
IFS=$_cpool_ifs
exec "$@"
"""
# The first step as the tenant: the job's environment back (sandbox.root_side_env), then the work dir.
_TAIL = (
    f'_i=0; _s=; while eval "[ -n \\"\\${{{HANDOVER}$_i+x}}\\" ]"; do '
    f'eval "_s=\\$_s\\${HANDOVER}$_i"; unset {HANDOVER}$_i; _i=$((_i + 1)); done; '
    'eval "$_s"; unset _i _s; cd -- "$1" 2>/dev/null || cd /; shift; exec "$@"'
)


class ExecRefused(Exception):
    """Why nothing can be run or reached in this job (said to the user as is)."""


@dataclass(frozen=True)
class JobView:
    """A running process job as exec and forward see it."""

    rec: JobRecord
    init_pid: int | None  # PID 1 of the job's PID namespace (None: the job has no namespaces)
    work: Path
    user: pwd.struct_passwd | None  # None: the agent runs jobs as itself
    podman: tuple[str, ...] = ()  # a container job: how the agent runs podman, and its container
    container: str = ""


@dataclass
class HeldNamespaces:
    """A job's namespace files, open in the agent (kind -> fd), taken from its init while it was
    provably the job's; closed by `close` once what joins them has done so."""

    fds: dict[str, int]
    root: int = -1  # the job's root directory as its mount namespace has it (O_PATH), with "mnt"

    def path(self, kind: str) -> str:
        """A path any root process of the host opens as this very namespace (not as a pid's)."""
        return f"/proc/{os.getpid()}/fd/{self.fds[kind]}"

    def close(self) -> None:
        for fd in (*self.fds.values(), *([self.root] if self.root >= 0 else [])):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds, self.root = {}, -1

    def __enter__(self) -> HeldNamespaces:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def hold_namespaces(view: JobView, kinds: Sequence[str] = EXEC_NAMESPACES) -> HeldNamespaces:
    """The job's namespaces, opened through its init's pid only while a pidfd shows that pid is
    still the job's process (see the module's text). Raises ExecRefused when it is not."""
    pid = view.init_pid
    if pid is None:
        raise ExecRefused("the job has no namespaces of its own on this node")
    gone = ExecRefused(f"allocation {view.rec.allocation_id}'s job ended (its namespaces are gone)")
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise gone from None
    held = HeldNamespaces({})
    try:
        if not _still_the_jobs(view, pid):
            raise gone
        for kind in kinds:
            held.fds[kind] = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
        if "mnt" in kinds:
            held.root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        if _exited(pidfd):  # it may have ended (and its pid been taken) before the files were opened
            raise gone
    except OSError:
        held.close()
        raise gone from None
    except ExecRefused:
        held.close()
        raise
    finally:
        os.close(pidfd)
    return held


TIOCSPTLCK, TIOCGPTPEER = 0x40045431, 0x5441  # asm-generic/ioctls.h: unlock a pty; open its peer


def open_pty(held: HeldNamespaces | None) -> tuple[int, int]:
    """(master, slave) of a terminal for an exec'd command: in the job's own devpts instance
    (sandbox.py), so that the command's `tty` names it there, and counted in the job's ptys, not
    the host's; the host's for a job without a mount namespace of its own."""
    if held is None or held.root < 0:
        return os.openpty()
    flags = os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        master = os.open("dev/pts/ptmx", flags, dir_fd=held.root)
    except FileNotFoundError:  # no /dev/pts in the job's view
        return os.openpty()
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ExecRefused("the job holds every terminal it may have: none is left") from None
        raise
    try:
        fcntl.ioctl(master, TIOCSPTLCK, struct.pack("i", 0))
        slave = fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY)  # never by its path
    except OSError:
        os.close(master)
        raise
    return master, slave


def _still_the_jobs(view: JobView, pid: int) -> bool:
    """Whether `pid` names a process of the job now: the container's process as the engine says,
    or a descendant of the job's leader (known by pid and start time)."""
    if view.container:
        return container_pid(view.podman, view.container) == pid
    try:
        leader = psutil.Process(view.rec.pid)
        if abs(leader.create_time() - view.rec.create_time) >= 0.05:
            return False
        return any(p.pid == pid for p in leader.children(recursive=True))
    except psutil.Error:
        return False


def _exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited (a zombie too)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _same_ns(fd: int, kind: str) -> bool:
    """Whether an open namespace file is the agent's own namespace of that kind."""
    mine, theirs = os.stat(f"/proc/self/ns/{kind}"), os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def _ns(pid: int | str, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def find_init(rec: JobRecord) -> int | None:
    """The job's namespaces' init: the first of its processes in a PID namespace not the agent's,
    once it has started the command (its mounts, a private /tmp and the data dir hidden, are made
    by then). None before, and for a job without namespaces."""
    try:
        leader = psutil.Process(rec.pid)
        if abs(leader.create_time() - rec.create_time) >= 0.05:
            return None
        procs = sorted(leader.children(recursive=True), key=lambda p: (p.create_time(), p.pid))
    except psutil.Error:
        return None
    mine = _ns("self", "pid")
    for p in procs:
        with contextlib.suppress(OSError, psutil.Error):
            if _ns(p.pid, "pid") != mine:
                return p.pid if p.children() else None
    return None


def job_env(view: JobView) -> dict[str, str]:
    """The job's environment, as its first process of the tenant's user started with it; in a job
    that has just started and runs none yet, as handed to its first step (the agent's own child)."""
    uid = view.user.pw_uid if view.user is not None else os.geteuid()
    root = view.init_pid if view.init_pid is not None else view.rec.pid
    with contextlib.suppress(psutil.Error):
        procs = sorted(psutil.Process(root).children(recursive=True), key=lambda p: (p.create_time(), p.pid))
        for p in procs:
            with contextlib.suppress(psutil.Error):
                if p.uids().real == uid:
                    return handed_over(dict(p.environ()))
    with contextlib.suppress(psutil.Error):
        leader = psutil.Process(view.rec.pid)
        if abs(leader.create_time() - view.rec.create_time) < 0.05:
            return handed_over(dict(leader.environ()))
    return {"PATH": FIXED_PATH, "HOME": str(view.work)}


def handed_over(env: dict[str, str]) -> dict[str, str]:
    """The job's environment from a process's: where that process has not yet applied the
    handover (its first step as the tenant, just started), the handed-over variables."""
    chunks = sorted((int(k[len(HANDOVER) :]), v) for k, v in env.items() if k.startswith(HANDOVER))
    if not chunks:
        return env
    try:  # `unset PATH LANG` and `export NAME='value'` words (sandbox.root_side_env)
        words = shlex.split("".join(v for _, v in chunks))
    except ValueError:
        return {}
    out: dict[str, str] = {}
    for prev, word in zip(words, words[1:], strict=False):
        if prev == "export" and "=" in word:
            name, _, value = word.partition("=")
            out[name] = value
    return out


def exec_argv(
    view: JobView,
    host: HostSupport | None,
    command: Sequence[str],
    tty: bool,
    held: HeldNamespaces | None = None,
) -> tuple[list[str], dict[str, str]]:
    """argv and environment that run `command` in the job's sandbox (see the module's text). A job
    with namespaces needs them `held` (hold_namespaces), open until the command has started."""
    if view.init_pid is not None and (held is None or set(held.fds) != set(EXEC_NAMESPACES)):
        raise ValueError("a job with namespaces is entered only through its held namespace files")
    env = job_env(view)
    if tty:
        env.setdefault("TERM", "xterm-256color")
    user = view.user
    # on a terminal: a session of its own, made inside the job's PID namespace, with the pty as its
    # controlling terminal (a shell's job control then names only process groups it can see)
    session = ["setsid", "--ctty", "--wait"] if tty else []
    if host is None or not host.root or host.setpriv is None or user is None:
        # the agent runs jobs as itself (not root): the command runs likewise, in the job's dir
        argv = ["/bin/sh", "-c", 'cd -- "$1" 2>/dev/null || cd /; shift; exec "$@"', "cpool-exec"]
        return [*session, *argv, str(view.work), *command], env
    argv = ["/bin/sh", "-c", _TAIL, "cpool-exec", str(view.work), *command]
    argv = [host.setpriv, "--reuid", str(user.pw_uid), "--regid", str(user.pw_gid), "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--", *argv]  # fmt: skip
    if host.filter_loader:  # its source on the line: where the package lives may be hidden in the job
        source = Path(syscall_filter.__file__).read_text()
        argv = [host.filter_loader[0], "-I", "-c", source, "--", *argv]
    argv = [*session, *argv]
    if host.scope_why_not == "" and (held is None or _same_ns(held.fds["net"], "net")):
        python = host.filter_loader[0] if host.filter_loader else sys.executable
        argv = [python, "-I", "-c", Path(landlock.__file__).read_text(), "--", *argv]
    if held is not None:
        argv = ["nsenter", *(f"{_NSENTER[k]}={held.path(k)}" for k in EXEC_NAMESPACES), "--", *argv]
    cgroups = view.rec.extra.get("cgroup_paths") or view.rec.cgroup or ""
    argv = [*held_as_the_job(view.rec), "/bin/sh", "-c", _JOIN_CGROUPS, "cpool-exec-cgroup", cgroups, *argv]
    return argv, root_side_env(env)


def _on_the_nodes_network(init_pid: int | None) -> bool:
    """Whether the job's processes share the agent's network namespace (or it is gone: then as if)."""
    if init_pid is None:
        return True
    try:
        return _ns(init_pid, "net") == _ns("self", "net")
    except OSError:
        return True


def held_as_the_job(rec: JobRecord) -> list[str]:
    """What holds the job where it has no cgroup (cgroups.py's fallback): its memory and process
    rlimits and its CPUs, read from its first process, as a prefix (util-linux prlimit, taskset)."""
    out: list[str] = []
    try:
        leader = psutil.Process(rec.pid)
        limits = {name: leader.rlimit(res) for name, res in _RLIMITS}
        cpus = leader.cpu_affinity() or []
    except (psutil.Error, OSError):
        return out
    shown = [f"--{name}={_limit(soft)}:{_limit(hard)}" for name, (soft, hard) in limits.items()]
    if any(soft != psutil.RLIM_INFINITY or hard != psutil.RLIM_INFINITY for soft, hard in limits.values()):
        out += ["prlimit", *shown, "--"]
    if cpus and len(cpus) < (os.cpu_count() or 0):
        out += ["taskset", "--cpu-list", ",".join(map(str, cpus))]
    return out


def _limit(value: int) -> str:
    return "unlimited" if value == psutil.RLIM_INFINITY else str(value)


def container_exec_argv(
    view: JobView, command: Sequence[str], tty: bool, host: HostSupport | None = None
) -> list[str]:
    """`podman exec` in a container job: its namespaces, cgroup, user, capabilities (none),
    seccomp profile and no_new_privs, its environment and working dir, as the container has them.
    On a terminal podman makes the container's own pty and passes window sizes to it.

    A container on the host's network (a function's worker) runs in a Landlock domain scoped for
    abstract sockets (launch.py), which `podman exec` cannot join: what it started would reach
    every abstract socket of the node, and podman in a domain of its own cannot enter the
    container (runc's setns needs to trace its process). So exec is refused there."""
    if host is not None and host.scope_why_not == "" and _on_the_nodes_network(view.init_pid):
        raise ExecRefused(
            "the container uses the node's network (a function's worker): a command exec'd into it "
            "would escape its Landlock scope, so exec is refused"
        )
    args = ["exec", "--interactive", *(["--tty"] if tty else []), view.container, *command]
    argv = [*view.podman, *args]
    return ["setsid", "--ctty", "--wait", *argv] if tty else argv


def container_pid(podman: Sequence[str], container: str) -> int | None:
    """The container's first process on the host (its namespaces'), or None when it runs no more."""
    try:
        done = subprocess.run(
            [*podman, "inspect", "--format", "{{.State.Pid}}", container],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    pid = done.stdout.strip()
    return int(pid) if done.returncode == 0 and pid.isdigit() and int(pid) > 0 else None


def describe(argv: Sequence[str]) -> str:
    """For logs: the argv without the filter's source."""
    return shlex.join(a if len(a) < 200 else "<source>" for a in argv)


def connect_in_job(view: JobView, port: int) -> socket.socket:
    """A TCP connection to 127.0.0.1:`port` in the job's own network namespace. Raises ExecRefused."""
    if view.init_pid is None:
        raise ExecRefused("the job has no network namespace of its own on this node: nothing to forward to")
    with hold_namespaces(view, ("net",)) as held:
        if _same_ns(held.fds["net"], "net"):
            raise ExecRefused(
                "the job uses the node's network (a gang member, or a job given ports): forwarding to "
                "its loopback would reach the node's own services, so it is refused"
            )
        got = _connect_in(held.fds["net"], port)
    if isinstance(got, socket.socket):
        got.settimeout(None)
        return got
    if isinstance(got, ConnectionRefusedError):
        raise ExecRefused(f"nothing listens on port {port} in the job (connection refused)")
    why = getattr(got, "strerror", None) or str(got)
    raise ExecRefused(f"cannot connect to port {port} in the job: {why}")


def _connect_in(netns: int, port: int) -> socket.socket | BaseException:
    """A connection to 127.0.0.1:`port` made in the network namespace open as `netns`."""
    out: list[socket.socket | BaseException] = []

    def inside() -> None:  # a thread of its own: setns moves only this thread
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            out.append(e)
            return
        try:
            if libc.setns(netns, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                out.append(OSError(err, os.strerror(err)))
                return
            try:
                out.append(socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT_S))
            except OSError as e:
                out.append(e)
            finally:
                if libc.setns(own, CLONE_NEWNET) != 0:  # the thread ends here anyway
                    pass
        finally:
            os.close(own)

    t = threading.Thread(target=inside, name="cpool-forward-connect", daemon=True)
    t.start()
    t.join()
    return out[0] if out else OSError("no answer")
