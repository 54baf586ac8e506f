"""The pool's reserved ports: a job may listen there only on a port the pool gave it.

The control plane hands out the ports of its ranges one at a time: a service replica's port, a
cooperative RPC server's port, a container's published port. Process jobs share the node's
network, so without a guard one tenant's job could bind every port of a range (any family, any
address) and no replica or RPC server of another tenant could start on the node again. The agent
looks at the node's LISTEN sockets in those ranges on every pass: a socket held by a job's process
that was not given that port stops the job, with the port named in its reason (Kubernetes' hostPort
has the same rule: a pod uses only the host ports it declared). The gang range is not among them
(server/logic/nodes.py `reserved_ports` says why); a gang's rank 0 may still listen on the master
port it offers, wherever that lies.

A port the kernel may hand out by itself (its ephemeral range, `net.ipv4.ip_local_port_range`,
less `ip_local_reserved_ports`) is not policed: a job that binds port 0 may get it, and nothing
tells that apart from a squat. The default ranges lie below the kernel's default ephemeral range
but for the top of the RPC range; once it learns the ranges, the agent logs which reserved ports
go unpoliced, and an operator who reserves them in the kernel
(`sysctl net.ipv4.ip_local_reserved_ports=…`) has them policed too. A listener of no job (the
node's own services) is the operator's business and left alone.

The scan reads /proc/net/tcp{,6} once a pass; only a listener not seen before sends it through
the jobs' descriptors (listeners.socket_inodes), and a socket it cannot place is looked at again
a few passes later (a process the job just forked).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from computepool.agent.listeners import listening, socket_inodes
from computepool.agent.sockets import bound_port, socket_fds, tabled_sockets

log = logging.getLogger("computepool.agent")

GUARD_EVERY_S = 2.0
RETRY_UNPLACED_PASSES = 3  # a socket no job held at first: looked at again after this many passes
LISTEN_PORTS_EXTRA = "listen_ports"  # JobRecord.extra key: the reserved ports given, "p1,p2"


@dataclass(frozen=True)
class PortRange:
    """One range the pool reserves (its name says for what: service, rpc, publish)."""

    name: str
    lo: int
    hi: int

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.lo <= port <= self.hi


@dataclass(frozen=True)
class GuardedJob:
    """A running job as the guard sees it: its key, the reserved ports it was given, its processes."""

    key: str
    given: frozenset[int]
    pids: frozenset[int]


def parse_ranges(raw: Any) -> tuple[PortRange, ...]:
    """The heartbeat answer's `reserved_ports` ([{name, min, max}]); malformed items are skipped."""
    out: list[PortRange] = []
    for item in raw if isinstance(raw, list) else []:
        try:
            lo, hi = int(item["min"]), int(item["max"])
            if 1 <= lo <= hi <= 65535:
                out.append(PortRange(str(item.get("name") or "reserved"), lo, hi))
        except (KeyError, TypeError, ValueError):
            continue
    return tuple(out)


def port_list(text: str) -> set[int]:
    """The ports of a kernel port list, "1000-1002,2000" (ip_local_reserved_ports)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def kernel_may_pick(proc: Path = Path("/proc")) -> set[int]:
    """Ports the kernel may give a bind to port 0: its ephemeral range less its reserved ports."""
    sysctl = proc / "sys" / "net" / "ipv4"
    try:
        lo, hi = (int(p) for p in (sysctl / "ip_local_port_range").read_text().split())
        ephemeral = set(range(lo, hi + 1))
    except (OSError, ValueError):
        ephemeral = set(range(32768, 61000))  # Linux's default
    with contextlib.suppress(OSError):
        ephemeral -= port_list((sysctl / "ip_local_reserved_ports").read_text())
    return ephemeral


def given_ports(extra: Mapping[str, str]) -> frozenset[int]:
    """The reserved ports a job record says its job was given."""
    raw = extra.get(LISTEN_PORTS_EXTRA, "")
    return frozenset(int(p) for p in raw.split(",") if p.isdigit())


def ports_text(ports: Iterable[int | None]) -> str:
    return ",".join(str(p) for p in sorted({p for p in ports if p}))


class PortGuard:
    """Stops a job that listens on a reserved port it was not given (see the module).

    `jobs()` lists the running jobs, `stop(key, reason)` stops one; `ranges` comes from the
    control plane's heartbeat answer (empty until the first one: nothing is policed)."""

    def __init__(
        self,
        jobs: Callable[[], Iterable[GuardedJob]],
        stop: Callable[[str, str], None],
        every_s: float = GUARD_EVERY_S,
        proc: Path = Path("/proc"),
        kernel_picks: set[int] | None = None,
    ) -> None:
        self.jobs, self.stop_job, self.every_s, self.proc = jobs, stop, every_s, proc
        self._ranges: tuple[PortRange, ...] = ()
        self._free_for_kernel = kernel_may_pick(proc) if kernel_picks is None else kernel_picks
        self._owner: dict[int, tuple[str | None, int]] = {}  # inode → (job key or None, pass seen)
        self._stopped: set[tuple[str, int]] = set()
        self._seen: set[tuple[str, int]] = set()  # (job, port) found last pass: stopped if found again
        self._looked: dict[int, tuple[int | None, int]] = {}  # untabled socket → (bound port, pass)
        self._pass = 0
        self.read_pids: set[int] = set()  # the processes whose descriptors the last pass read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def ranges(self) -> tuple[PortRange, ...]:
        with self._lock:
            return self._ranges

    def set_ranges(self, ranges: tuple[PortRange, ...]) -> None:
        """The pool's ranges as the control plane last said; a change is logged once."""
        with self._lock:
            if ranges == self._ranges:
                return
            self._ranges = ranges
        for r in ranges:
            loose = sorted(p for p in range(r.lo, r.hi + 1) if p in self._free_for_kernel)
            if loose:
                log.warning(
                    "ports %d-%d of the pool's %s range lie in the kernel's ephemeral range: a job may "
                    "get one by binding port 0, so they are not policed (reserve them with sysctl "
                    "net.ipv4.ip_local_reserved_ports to police them)",
                    loose[0], loose[-1], r.name,
                )  # fmt: skip

    def policed(self, port: int) -> PortRange | None:
        """The range a port is policed in, or None."""
        if port in self._free_for_kernel:
            return None
        return next((r for r in self.ranges if port in r), None)

    def scan(self) -> list[tuple[str, int]]:
        """One pass: stops the jobs that listen on a reserved port not theirs; (key, port) each."""
        self._pass += 1
        self.read_pids = set()
        suspects: dict[int, tuple[int, PortRange]] = {}
        if self.ranges:
            for port, sockets in listening(self.proc).items():
                r = self.policed(port)
                if r is not None:
                    for inode in sockets:
                        suspects[inode] = (port, r)
        jobs = list(self.jobs()) if self.ranges else []
        hidden = self._bound_only(jobs)  # inode → (port, range, job): bound, never listening
        for inode, (port, r, holder) in hidden.items():
            suspects[inode] = (port, r)
            self._owner[inode] = (holder, self._pass)
        self._owner = {i: o for i, o in self._owner.items() if i in suspects}
        if not suspects:
            self._seen = set()
            return []
        unplaced = {
            i
            for i in suspects
            if i not in self._owner
            or (self._owner[i][0] is None and self._pass - self._owner[i][1] >= RETRY_UNPLACED_PASSES)
        }
        if unplaced:
            for i in unplaced:
                self._owner[i] = (None, self._pass)
            for job in jobs:
                held = set()
                for pid in self._on_the_nodes_network(job.pids):
                    held |= socket_inodes(pid, self.proc)
                for i in held & unplaced:
                    self._owner[i] = (job.key, self._pass)
        given = {j.key: j.given for j in jobs}
        stopped: list[tuple[str, int]] = []
        seen, self._seen = self._seen, set()
        for inode, (port, r) in sorted(suspects.items(), key=lambda kv: kv[1][0]):
            key = self._owner.get(inode, (None, 0))[0]
            if key is None or key not in given or port in given[key] or (key, port) in self._stopped:
                continue
            self._seen.add((key, port))
            if (key, port) not in seen:  # twice in a row: a job just started has its ports on record
                continue
            self._stopped.add((key, port))
            if any(k == key for k, _ in stopped):
                continue
            reason = (
                f"{'bound' if inode in hidden else 'listened on'} port {port}, which the pool reserves "
                f"for its {r.name} range ({r.lo}-{r.hi}) and did not give this job"
            )
            log.warning("%s: %s; stopping it", key, reason)
            self.stop_job(key, reason)
            stopped.append((key, port))
        live = set(given)
        self._stopped = {(k, p) for k, p in self._stopped if k in live}
        return stopped

    def _bound_only(self, jobs: list[GuardedJob]) -> dict[int, tuple[int, PortRange, str]]:
        """The jobs' TCP sockets bound to a policed port but listening nowhere: such a socket holds
        its port against every later bind, yet no /proc/net table lists it. Only sockets no table
        lists are looked into (through a copy of the descriptor: sockets.bound_port), each once,
        and one still unbound again a few passes later."""
        out: dict[int, tuple[int, PortRange, str]] = {}
        if not jobs:
            self._looked = {}
            return out
        tabled = tabled_sockets(self.proc)
        looked: dict[int, tuple[int | None, int]] = {}
        for job in jobs:
            for pid in self._on_the_nodes_network(job.pids):
                for inode, fd in socket_fds(pid, self.proc).items():
                    if inode in tabled:
                        continue
                    port, at = self._looked.get(inode, (None, -RETRY_UNPLACED_PASSES))
                    if inode not in self._looked or (
                        port is None and self._pass - at >= RETRY_UNPLACED_PASSES
                    ):
                        port, at = bound_port(pid, fd), self._pass
                    looked[inode] = (port, at)
                    r = self.policed(port) if port else None
                    if r is not None and port is not None:
                        out[inode] = (port, r, job.key)
        self._looked = looked
        return out

    def _on_the_nodes_network(self, pids: Iterable[int]) -> list[int]:
        """The pids in the agent's network namespace: only their sockets can hold the node's ports.
        A job's descriptors are its to multiply (20000 per process, all of one file, cost it a few
        MiB): looking through every one of a job with a network of its own cost the agent seconds
        of CPU each pass, outside any job's cgroup, for sockets that can never be the node's."""
        try:
            mine = os.stat(self.proc / "self" / "ns" / "net").st_ino
        except OSError:
            self.read_pids.update(pids)
            return list(pids)
        out = []
        for pid in pids:
            try:
                if os.stat(self.proc / str(pid) / "ns" / "net").st_ino == mine:
                    out.append(pid)
            except OSError:
                continue  # gone
        self.read_pids.update(out)
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.scan()
            except Exception:  # the guard must never take the agent down: log, try again next pass
                log.exception("checking the reserved ports failed")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cpool-port-guard", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
