"""Hold a job to its CPU, host memory and process count with cgroups, v2 or v1, whichever the host has.

A job's cgroup is named by the path of one directory (`JobRecord.cgroup`): the job's own directory
on a v2 hierarchy, or its memory-controller directory on v1, where each controller is a separate
mount (`/sys/fs/cgroup/cpu`, `/sys/fs/cgroup/memory`, `/sys/fs/cgroup/pids`, …) and the job has one
directory per controller, all listed in `paths`. Both list the job's processes in `cgroup.procs`,
so whatever only needs the members (the agent, the fence supervisor) reads that one path.

Each agent keeps its jobs under a directory of its own below the base (`<base>/<node key>/`,
identity.py): allocation ids are the pool's, so two agents on one host (two pools, or two nodes of
one pool) would otherwise put different jobs in one cgroup, and the first to end would kill the
other. An agent only ever creates, empties or removes cgroups under its own directory. Below it,
each tenant's jobs share a directory (`t-<digest of the tenant>/<alloc>.<attempt>`) whose pids.max
is the tenant's share of the node (`tenant_pids_budget`): one tenant forking to the limit of every
job it runs still leaves the other tenants' jobs room to start processes.

Where neither is writable (`--cgroup-base none`, a container without delegation), `hold` falls
back to RLIMIT_AS (per process: a job's children each get as much), CPU affinity and RLIMIT_NPROC
(per user: the tenant's processes on the node, all its jobs together), and says so in the job's
`limits`; `unheld_warning` says so once at a root agent's start.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

MIB = 1024 * 1024
CPU_PERIOD_US = 100_000
DEFAULT_PIDS_MAX = 1024  # a job's processes and threads, where the control plane sends no limit
JOBS_PID_SHARE = 0.75  # of the host's pid_max, for all of one agent's jobs together


def jobs_pids_budget(
    pid_max_path: Path = Path("/proc/sys/kernel/pid_max"),
    threads_max_path: Path = Path("/proc/sys/kernel/threads-max"),
) -> int:
    """Processes and threads one agent's jobs may hold together: three quarters of the host's
    pid_max, so that jobs forking to their limits (one tenant's or several) never leave the host,
    the agent or a fence supervisor without a process slot. Or of threads-max, where lower: the
    kernel sizes it from memory (1 M at 128 GiB) while systemd sets pid_max to 4 M, and past it
    every fork of the host fails, root's too (no capability exempts it), so a tenant's share of a
    budget taken from pid_max alone let one job stop the whole node's forks."""
    limits = []
    for path, default in ((pid_max_path, 32768), (threads_max_path, 0)):  # 32768: the kernel's default
        try:
            limits.append(int(path.read_text().strip()))
        except (OSError, ValueError):
            if default:
                limits.append(default)
    return max(64, int(min(limits) * JOBS_PID_SHARE))


def tenant_pids_budget(jobs_budget: int, asked: int = 0) -> int:
    """One tenant's processes and threads on the node, all its jobs together: `asked` where the
    operator set it (never past the agent's budget), else half of the agent's jobs' budget."""
    return min(asked, jobs_budget) if asked > 0 else max(64, jobs_budget // 2)


def tenant_group(tenant: str) -> str:
    """The directory a tenant's jobs share: a digest, so any tenant name makes a short, safe name."""
    return "t-" + hashlib.sha256(tenant.encode()).hexdigest()[:16] if tenant else ""


V1_CONTROLLERS = ("memory", "cpu", "pids")  # the first present one names the job's cgroup
_JOB_DIR = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*\.[0-9]+$")  # `<alloc>.<attempt>`
_GROUP_DIR = re.compile(r"^t-[0-9a-f]{16}$")  # `tenant_group`


@dataclass(frozen=True)
class JobCgroup:
    """Where one job's limits live: `path` (its member list) and every directory made for it."""

    version: str
    path: Path
    paths: tuple[Path, ...]
    # the CPU quota not yet written (file, value): the sandbox's init writes it as its last root
    # step, so that the pool's own launcher steps before the command are not throttled (`defer_cpu`)
    cpu_limit: tuple[Path, str] | None = None

    def describe(self, cpu_milli: int, memory_mib: int, pids_max: int) -> str:
        parts = [f"cpu {cpu_milli}m" if cpu_milli > 0 else "cpu unlimited"]
        parts.append(f"memory {memory_mib} MiB" if memory_mib > 0 else "memory unlimited")
        if pids_max > 0:
            parts.append(f"pids {pids_max}")
        return f"cgroup {self.version} {self.path}: " + ", ".join(parts)


class CgroupV2:
    """Child cgroups under a base directory on a cgroup v2 hierarchy (delegated to the agent).

    The base may lie several levels below the nearest cgroup that exists (`<base>/<node key>`): each
    level on the way is made and given the controllers its children need."""

    version = "v2"

    def __init__(self, base: Path, pids_budget: int | None = None, tenant_pids: int = 0) -> None:
        self.base = base
        self.pids_budget = pids_budget if pids_budget is not None else jobs_pids_budget()
        self.tenant_pids = tenant_pids_budget(self.pids_budget, tenant_pids)
        self._checked: tuple[bool, str] | None = None
        self._pids = False
        self._wanted: set[str] = set()

    def usable(self) -> tuple[bool, str]:
        if self._checked is None:
            self._checked = self._check()
        return self._checked

    def _check(self) -> tuple[bool, str]:
        top = next((p for p in (self.base, *self.base.parents) if (p / "cgroup.controllers").is_file()), None)
        if top is None:
            return False, f"no cgroup v2 hierarchy at {self.base.parent}"
        try:
            have = set((top / "cgroup.controllers").read_text().split())
            missing = {"cpu", "memory"} - have
            if missing:
                return False, f"cgroup controllers {sorted(missing)} not available in {top}"
            wanted = {"cpu", "memory"} | ({"pids"} & have)
            self._pids, self._wanted = "pids" in wanted, wanted
            below = [self.base, *self.base.parents][: len(self.base.relative_to(top).parts)]
            for level in (top, *reversed(below)):  # from the existing cgroup down to the base
                level.mkdir(exist_ok=True, mode=0o700)
                control = level / "cgroup.subtree_control"
                enabled = set(control.read_text().split()) if control.exists() else set()
                if not wanted <= enabled:
                    (level / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))
            if self._pids:  # all of this agent's jobs together (jobs_pids_budget)
                (self.base / "pids.max").write_text(str(self.pids_budget))
        except OSError as e:
            return False, f"cgroup {self.base} not writable: {e}"
        return True, ""

    def sweep(self, keep: set[str]) -> list[str]:
        """Remove the empty job cgroups under this base that no job holds (left by a crash)."""
        return _sweep([self.base], keep)

    def _group(self, group: str) -> Path:
        """The tenant's directory (made, its controllers enabled and its pids capped) or the base."""
        if not group:
            return self.base
        path = self.base / group
        path.mkdir(exist_ok=True)
        control = path / "cgroup.subtree_control"
        if not self._wanted <= set(control.read_text().split() if control.exists() else ()):
            control.write_text(" ".join(f"+{c}" for c in sorted(self._wanted)))
        if self._pids:
            (path / "pids.max").write_text(str(self.tenant_pids))
        return path

    def tenant_dir(self, group: str) -> Path | None:
        """The tenant's directory, made as for its jobs, for its containers' parents too
        (container_cgroups.py); None when this base is unusable."""
        return self._group(group) if self.usable()[0] else None

    def create(
        self,
        name: str,
        cpu_milli: int,
        memory_mib: int,
        pids_max: int = 0,
        defer_cpu: bool = False,
        group: str = "",
    ) -> JobCgroup:
        path = self._group(group) / name
        path.mkdir(exist_ok=True)
        cpu_limit: tuple[Path, str] | None = None
        if cpu_milli > 0:
            cpu_limit = (path / "cpu.max", f"{_quota_us(cpu_milli)} {CPU_PERIOD_US}")
            if not defer_cpu:
                cpu_limit[0].write_text(cpu_limit[1])
                cpu_limit = None
        if memory_mib > 0:
            (path / "memory.max").write_text(str(memory_mib * MIB))
            for name_, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                if (path / name_).exists():  # no swapping past the limit; an OOM ends the whole job
                    (path / name_).write_text(value)
        if pids_max > 0 and self._pids:
            cap = self.tenant_pids if group else self.pids_budget
            (path / "pids.max").write_text(str(min(pids_max, cap)))
        return JobCgroup("v2", path, (path,), cpu_limit)


class CgroupV1:
    """One directory per controller under `<mount>/<base name>` on a v1 (or hybrid) host; the base
    name may be a relative path (`computepool/<node key>`)."""

    version = "v1"

    def __init__(
        self, root: Path, base_name: str, pids_budget: int | None = None, tenant_pids: int = 0
    ) -> None:
        self.root = root
        self.base_name = base_name
        self.pids_budget = pids_budget if pids_budget is not None else jobs_pids_budget()
        self.tenant_pids = tenant_pids_budget(self.pids_budget, tenant_pids)
        self._checked: tuple[bool, str] | None = None
        self.controllers: tuple[str, ...] = ()

    def usable(self) -> tuple[bool, str]:
        if self._checked is None:
            self._checked = self._check()
        return self._checked

    def _check(self) -> tuple[bool, str]:
        have = tuple(c for c in V1_CONTROLLERS if (self.root / c / "cgroup.procs").exists())
        if not {"cpu", "memory"} <= set(have):
            return False, f"no cgroup v1 cpu and memory controllers under {self.root}"
        try:
            for c in have:
                (self.root / c / self.base_name).mkdir(parents=True, exist_ok=True, mode=0o700)
            if "pids" in have:  # all of this agent's jobs together (jobs_pids_budget)
                (self.root / "pids" / self.base_name / "pids.max").write_text(str(self.pids_budget))
        except OSError as e:
            return False, f"cgroup v1 {self.root}/*/{self.base_name} not writable: {e}"
        self.controllers = have
        return True, ""

    def sweep(self, keep: set[str]) -> list[str]:
        """Remove the empty job cgroups under this base that no job holds (left by a crash)."""
        return _sweep([self.root / c / self.base_name for c in V1_CONTROLLERS], keep)

    def create(
        self,
        name: str,
        cpu_milli: int,
        memory_mib: int,
        pids_max: int = 0,
        defer_cpu: bool = False,
        group: str = "",
    ) -> JobCgroup:
        """`group`: the tenant's directory (`tenant_group`), its pids capped at `tenant_pids`."""
        rel = self._group(group)
        dirs = {c: self.root / c / rel / name for c in self.controllers}
        for d in dirs.values():
            d.mkdir(exist_ok=True)
        cpu_limit: tuple[Path, str] | None = None
        if cpu_milli > 0:
            (dirs["cpu"] / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            cpu_limit = (dirs["cpu"] / "cpu.cfs_quota_us", str(_quota_us(cpu_milli)))
            if not defer_cpu:
                cpu_limit[0].write_text(cpu_limit[1])
                cpu_limit = None
        if memory_mib > 0:
            mem = dirs["memory"]
            (mem / "memory.limit_in_bytes").write_text(str(memory_mib * MIB))
            if (mem / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swapping past it
                with contextlib.suppress(OSError):
                    (mem / "memory.memsw.limit_in_bytes").write_text(str(memory_mib * MIB))
            # v1 charges a cgroup's TCP buffers to nothing until it has a TCP limit of its own: a job
            # of 64 MiB held 300 MiB of them on its own loopback (peers that never read), all of it
            # in the host's one TCP budget (tcp_mem), past which no socket of the node gets memory
            if (mem / "memory.kmem.tcp.limit_in_bytes").exists():
                with contextlib.suppress(OSError):
                    (mem / "memory.kmem.tcp.limit_in_bytes").write_text(str(memory_mib * MIB))
        if pids_max > 0 and "pids" in dirs:
            cap = self.tenant_pids if group else self.pids_budget
            (dirs["pids"] / "pids.max").write_text(str(min(pids_max, cap)))
        ordered = tuple(dirs[c] for c in V1_CONTROLLERS if c in dirs)
        return JobCgroup("v1", ordered[0], ordered, cpu_limit)

    def _group(self, group: str) -> str:
        """The tenant's directory relative to each controller's mount (made, its pids capped), or the base."""
        if not group:
            return self.base_name
        rel = f"{self.base_name}/{group}"
        for c in self.controllers:
            (self.root / c / rel).mkdir(exist_ok=True)
        if "pids" in self.controllers:
            (self.root / "pids" / rel / "pids.max").write_text(str(self.tenant_pids))
        return rel

    def tenant_dir(self, group: str) -> Path | None:
        """The tenant's directory, made as for its jobs, in the memory hierarchy (the same path is
        made in every controller's), for its containers' parents too (container_cgroups.py); None
        when this base is unusable."""
        return self.root / "memory" / self._group(group) if self.usable()[0] else None


def _quota_us(cpu_milli: int) -> int:
    """CPU time per period for `cpu_milli` thousandths of a CPU (the kernel's floor is 1 ms)."""
    return max(1000, cpu_milli * CPU_PERIOD_US // 1000)


Cgroups = CgroupV2 | CgroupV1


def detect(base: Path, tenant_pids: int = 0) -> Cgroups:
    """v2 when the nearest cgroup above `base` is on a v2 hierarchy; v1 when the nearest directory
    above it holds the v1 controllers' mounts (`<it>/memory`, `<it>/cpu`, ...); `base` may lie
    several levels below either. `tenant_pids`: one tenant's share (`tenant_pids_budget`)."""
    for above in base.parents:
        if (above / "cgroup.controllers").is_file():
            return CgroupV2(base, tenant_pids=tenant_pids)
        if (above / "memory" / "memory.limit_in_bytes").is_file():
            return CgroupV1(above, str(base.relative_to(above)), tenant_pids=tenant_pids)
    return CgroupV2(base, tenant_pids=tenant_pids)  # says why it is unusable


def add(cg: JobCgroup, pid: int) -> None:
    """Move `pid` (and, as it forks later, its children) into every directory of the job."""
    for p in cg.paths:
        (p / "cgroup.procs").write_text(str(pid))


def pids(path: Path) -> set[int]:
    try:
        return {int(x) for x in (path / "cgroup.procs").read_text().split()}
    except (OSError, ValueError):
        return set()


def oom_kills(path: Path) -> int:
    """Processes the kernel killed for the cgroup's memory limit (v2 memory.events, v1 oom_control)."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            text = (path / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                with contextlib.suppress(ValueError):
                    return int(value)
    return 0


def _sweep(bases: list[Path], keep: set[str]) -> list[str]:
    """rmdir the `<alloc>.<attempt>` directories under `bases` (and under their tenants' directories)
    not in `keep`; one with processes stays (the kernel refuses). Nothing outside `bases` is looked at.
    The tenants' directories stay: a job may be starting in one."""
    gone: set[str] = set()
    for base in bases:
        try:
            groups = [c for c in base.iterdir() if c.is_dir() and _GROUP_DIR.match(c.name)]
        except OSError:
            continue
        for parent in (base, *groups):
            try:
                children = [c for c in parent.iterdir() if c.is_dir() and _JOB_DIR.match(c.name)]
            except OSError:
                continue
            for child in children:
                if child.name not in keep:
                    with contextlib.suppress(OSError):
                        child.rmdir()
                        gone.add(child.name)
    return sorted(gone)


def remove(paths: list[Path]) -> None:
    """rmdir once the last killed process has left (the kernel takes a moment)."""
    for path in paths:
        for _ in range(50):
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)


@dataclass(frozen=True)
class Held:
    """How one job is held: in words, and what the executor must keep watching itself."""

    limits: str
    cgroup: JobCgroup | None = None
    rss_limit_mib: int = 0  # host memory watched by RSS (GPU jobs without a cgroup)
    cpus: tuple[int, ...] = ()  # the CPUs it is pinned to (no cgroup)


def hold(
    engine: Cgroups | None,
    name: str,
    pid: int,
    *,
    cpu_milli: int,
    memory_mib: int,
    pids_max: int,
    uses_gpu: bool,
    busy_cpus: list[int],
    defer_cpu: bool = False,
    group: str = "",
) -> Held:
    """cgroups (v2 or v1) when they are writable, else rlimits and CPU affinity as a best effort.

    `pid` is the job's gated wrapper: whatever it starts inherits the limits. `busy_cpus` are the
    CPUs other jobs are pinned to, so that pinned jobs spread out instead of piling on CPU 0.
    `defer_cpu`: the CPU quota is left for the job's sandbox to write before the command runs
    (`JobCgroup.cpu_limit`); the memory and pids limits hold from the start. `group`: the
    tenant's directory (`tenant_group`), which caps its jobs' processes together.
    """
    if cpu_milli <= 0 and memory_mib <= 0 and pids_max <= 0:
        return Held("none")
    why = "cgroups disabled"
    if engine is not None:
        ok, why = engine.usable()
        if ok:
            cg = engine.create(name, cpu_milli, memory_mib, pids_max, defer_cpu=defer_cpu, group=group)
            try:
                add(cg, pid)
            except OSError:
                remove(list(cg.paths))
                raise
            return Held(cg.describe(cpu_milli, memory_mib, pids_max), cg)
    parts: list[str] = []
    rss = 0
    cpus: tuple[int, ...] = ()
    if pids_max > 0 and psutil.Process(pid).uids().real == 0:
        # counted per real uid: the tenant's user (setpriv switches to it) on the whole node; a job of
        # the agent's own non-root user would count the agent's threads too, so it gets none
        psutil.Process(pid).rlimit(psutil.RLIMIT_NPROC, (pids_max, pids_max))
        parts.append(f"RLIMIT_NPROC {pids_max} for the user (all its jobs on this node together)")
    if memory_mib > 0:
        if uses_gpu:  # GPU runtimes reserve vast address space: RLIMIT_AS would stop them at once
            rss = memory_mib
            parts.append(f"host memory {memory_mib} MiB watched by RSS")
        else:
            psutil.Process(pid).rlimit(psutil.RLIMIT_AS, (memory_mib * MIB, memory_mib * MIB))
            parts.append(f"RLIMIT_AS {memory_mib} MiB")
    if cpu_milli > 0:
        cpus = _pick_cpus(math.ceil(cpu_milli / 1000), busy_cpus)
        os.sched_setaffinity(pid, cpus)
        parts.append(f"affinity to {len(cpus)} CPU(s) {list(cpus)} (rlimits cannot cap CPU share)")
    if not parts:
        return Held(f"none ({why})")
    return Held("; ".join(parts) + f" ({why})", None, rss, cpus)


def unheld_warning(base: Path | None, root: bool) -> str:
    """One line for a root agent (it serves every tenant) whose jobs no cgroup can hold, else "".

    Checks `base` the way the executor will (making it where it can)."""
    if not root:
        return ""
    why = "cgroups disabled (--cgroup-base none)"
    if base is not None:
        ok, why = detect(base).usable()
        if ok:
            return ""
    return (
        f"no usable cgroups ({why}): tenants' jobs are held by rlimits alone: memory per process "
        "(RLIMIT_AS; a job's children each get as much, and GPU jobs none), CPU by affinity only, "
        "processes per tenant user on the node (RLIMIT_NPROC); one tenant's job can starve another's"
    )


def _pick_cpus(n: int, busy: list[int]) -> tuple[int, ...]:
    """The n CPUs least used by other jobs' affinity."""
    allowed = sorted(os.sched_getaffinity(0))
    load = dict.fromkeys(allowed, 0)
    for c in busy:
        if c in load:
            load[c] += 1
    return tuple(sorted(sorted(allowed, key=lambda c: (load[c], c))[: max(1, min(n, len(allowed)))]))
