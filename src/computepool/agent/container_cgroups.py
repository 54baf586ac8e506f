"""The parent cgroups a root agent makes for its container jobs (`podman run --cgroup-parent`).

Where the agent's job cgroups work, a container's parent is `<name>.ctr` in its tenant's
directory of the agent's own (`<base>/<node key>/t-<digest>/`, cgroups.py), beside the tenant's
process jobs: one pids cap holds all of one tenant's processes on the node, containers and process
jobs together, and the agent's whole budget holds every tenant's (a tree of the containers' own
let a tenant hold its share twice, and containers were outside the agent's budget). Elsewhere it
is `computepool-containers/<agent id>-<tenant's group>/<name>` in each hierarchy, whose tenant's
level is capped the same way. In both:

- the job's own level holds its memory limit. It outlives the container, so after the end the
  agent can still tell whether the kernel killed the job for memory (podman's own OOMKilled flag
  stays false on cgroup v1);
- nothing of it is readable by jobs: the agent's base is 0700, and so is
  `computepool-containers` in every hierarchy (runc made it 0755, so any job of the node could
  list the containers' cgroups, with their allocation ids and tenants' digests, and read their
  memory and process counts). A container sees its own cgroup through a mount of it, never
  through this path. The `.ctr` suffix keeps the agent's sweep of left job cgroups off it.

The tenant's level stays when its last container goes: another may be starting in it.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from computepool.agent.cgroups import Cgroups, tenant_group

CGROUP_PARENT = "computepool-containers"
SUFFIX = ".ctr"  # a container's parent beside its tenant's jobs: never `<alloc>.<attempt>`
MIB = 1024 * 1024
_CONTROLLERS = ("cpu", "memory", "pids")


class ContainerCgroups:
    """One agent's containers' parents under `root` (`/sys/fs/cgroup`), v2 or v1/hybrid."""

    def __init__(self, root: Path, agent_id: str, tenant_pids: int, jobs: Cgroups | None = None) -> None:
        """`jobs`: the agent's job cgroups, whose tenants' directories hold the containers' parents."""
        self.root = root
        self.agent_id = agent_id
        self.tenant_pids = tenant_pids
        self.jobs = jobs
        self._top_closed = False

    def _v2(self) -> bool:
        return (self.root / "cgroup.controllers").exists()

    def _top(self) -> Path:
        return self.root if self._v2() else self.root / "memory"

    def _shared(self, tenant: str) -> str | None:
        """The tenant's directory of the agent's jobs, relative to the hierarchy's root, when usable."""
        if self.jobs is None:
            return None
        try:
            path = self.jobs.tenant_dir(tenant_group(tenant))
            return str(path.relative_to(self._top())) if path is not None else None
        except (OSError, ValueError):
            return None

    def _tenant_rel(self, tenant: str) -> str:
        return f"{CGROUP_PARENT}/{self.agent_id}-{tenant_group(tenant)}" if tenant else CGROUP_PARENT

    def _rel(self, name: str, tenant: str) -> tuple[str, bool]:
        """The container's parent and whether it is beside the tenant's jobs."""
        shared = self._shared(tenant)
        if shared is not None:
            return f"{shared}/{name}{SUFFIX}", True
        return f"{self._tenant_rel(tenant)}/{name}", False

    def _rels(self, name: str) -> list[str]:
        """Where a container's parent may be when its tenant is not at hand (removal after a crash)."""
        top = self._top()
        found = [str(p.relative_to(top)) for p in (top / CGROUP_PARENT).glob(f"{self.agent_id}-t-*/{name}")]
        base = self._shared("")
        if base is not None:
            found += [str(p.relative_to(top)) for p in (top / base).glob(f"t-*/{name}{SUFFIX}")]
            found.append(f"{base}/{name}{SUFFIX}")
        return [*found, f"{CGROUP_PARENT}/{name}"]

    def memory_dir(self, name: str, tenant: str = "") -> Path:
        rel = self._rel(name, tenant)[0] if tenant else self._rels(name)[0]
        return self._top() / rel

    def _close_top(self) -> None:
        if self._top_closed:
            return
        tops = [self.root] if self._v2() else [d for d in self.root.iterdir() if d.is_dir()]
        for hierarchy in tops:
            if (hierarchy / "cgroup.procs").exists():
                top = hierarchy / CGROUP_PARENT
                top.mkdir(exist_ok=True)
                os.chmod(top, 0o700)
        self._top_closed = True

    def parent_args(self, name: str, memory_mib: int, tenant: str = "") -> list[str]:
        """`podman run` options for container `name`: its parent (made, with its memory limit, below
        its tenant's); podman's own --memory and no parent only where that fails."""
        if memory_mib <= 0 and not tenant:
            return []
        limit = memory_mib * MIB
        try:
            rel, shared = self._rel(name, tenant)
            tenant_rel = rel.rsplit("/", 1)[0]
            if not shared:
                self._close_top()
            if self._v2():
                levels = [self.root / rel] if shared else [self.root / CGROUP_PARENT, self.root / tenant_rel]
                _enable(self.root)
                for level in dict.fromkeys(
                    [*levels, self.root / rel]
                ):  # tenant's level: the top's without one
                    level.mkdir(exist_ok=True)
                    _enable(level)
                if tenant and not shared:
                    (self.root / tenant_rel / "pids.max").write_text(str(self.tenant_pids))
                path = self.root / rel
                if memory_mib > 0:
                    (path / "memory.max").write_text(str(limit))
                    with contextlib.suppress(OSError):
                        (path / "memory.swap.max").write_text("0")
            else:
                if tenant and not shared and (self.root / "pids").is_dir():  # podman makes the job's level
                    (self.root / "pids" / tenant_rel).mkdir(parents=True, exist_ok=True)
                    (self.root / "pids" / tenant_rel / "pids.max").write_text(str(self.tenant_pids))
                path = self.root / "memory" / rel
                path.mkdir(parents=True, exist_ok=True)
                if memory_mib > 0:
                    (path / "memory.limit_in_bytes").write_text(str(limit))
                    with contextlib.suppress(OSError):  # absent without swap accounting
                        (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
        except OSError:
            return [f"--memory={limit}", f"--memory-swap={limit}"] if memory_mib > 0 else []
        return [f"--cgroup-parent=/{rel}"]

    def out_of_memory(self, name: str, exit_code: int | None, tenant: str = "") -> bool:
        """Did the kernel kill the container for memory? Ask before `remove` takes the cgroup away.

        cgroup v2 counts OOM kills up the tree, so the parent's memory.events says it. cgroup v1
        counts them only in the container's own cgroup, which runc deletes at exit: there the
        answer is "killed by SIGKILL (137, or -9) after its peak use reached the limit".
        """
        path = self.memory_dir(name, tenant)
        try:
            if self._v2():
                for line in (path / "memory.events").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value) > 0
                return False
            if exit_code not in (137, -9):
                return False
            peak = int((path / "memory.max_usage_in_bytes").read_text())
            limit = int((path / "memory.limit_in_bytes").read_text())
        except (OSError, ValueError):
            return False
        return peak >= limit - MIB

    def remove(self, name: str) -> None:
        """The container's parent in every hierarchy; its tenant's level stays."""
        rels = self._rels(name)
        dirs = (
            [self.root / rel for rel in rels]
            if self._v2()
            else [d for rel in rels for d in self.root.glob(f"*/{rel}")]
        )
        for d in dirs:
            for sub in sorted(d.glob("**/"), key=lambda p: len(p.parts), reverse=True):
                for _ in range(50):  # the kernel needs a moment after the last process left
                    try:
                        sub.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.02)


def _enable(path: Path) -> None:
    have = set((path / "cgroup.subtree_control").read_text().split())
    missing = [c for c in _CONTROLLERS if c not in have]
    if missing:
        (path / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in missing))
