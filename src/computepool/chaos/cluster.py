"""The pool a chaos run faults: server replicas on one PostgreSQL, root agents with simulated GPUs.

Everything runs as real processes under one directory of the run. Each agent and everything it
starts (supervisors, jobs) stays in a freezer cgroup of the run's own, so a whole node freezes
and thaws with one write, as a hung machine would: on cgroup v2 `<root>/cpool-chaos-ID/node-N`
(the agent in `agent/`, its jobs below `jobs/` through `--cgroup-base`) and `cgroup.freeze`; on
a v1 or hybrid host the v1 freezer's `cpool-chaos-ID/node-N` (the agent's job cgroups touch no
freezer, so its jobs stay there) and `freezer.state`; with neither, SIGSTOP of the agent's
tree. Replicas share the first one's key files, as a deployment's do.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from computepool.chaos.postgres import TempPostgres

CGROUP_ROOT = Path("/sys/fs/cgroup")
SIMULATE = "2xA100-80GB"


class ClusterError(RuntimeError):
    """A part of the pool would not start (the message says which, with its log's tail)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpool_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "computepool.cli.main", *args]


@dataclass
class Part:
    """One process of the pool: a server replica or an agent, restartable with the same argv."""

    name: str
    argv: list[str]
    log: Path
    cgroup: Path | None = None  # the cgroup an agent is put in (see NodeFreezer)
    proc: subprocess.Popen[bytes] | None = None
    frozen: bool = False

    def start(self, env: dict[str, str]) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                (self.cgroup / "cgroup.procs").write_text(str(self.proc.pid))
        self.frozen = False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.alive and self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """kill -9, and reap it."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        self.frozen = False

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


@dataclass
class Cluster:
    """`servers` replicas and `agents` nodes under `root`; `start()` brings them up."""

    root: Path
    servers: int = 2
    agents: int = 3
    heartbeat_s: float = 1.0
    suspect_s: float = 3.0
    lost_s: float = 8.0
    parts: dict[str, Part] = field(default_factory=dict)
    urls: list[str] = field(default_factory=list)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    admin_token: str = ""
    blob_mount: Path | None = None  # the replicas' blob dir on a 64 MiB tmpfs (root only), to fill

    def __post_init__(self) -> None:
        self.pg = TempPostgres(self.root / "pg")
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.env.pop("CPOOL_SERVER", None)
        self.freezer = NodeFreezer(f"cpool-chaos-{self.run_id}")

    # ---- start and stop ---------------------------------------------------------------------
    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        self.pg.init()
        self.pg.start()
        blobs = self.root / "blobs"
        blobs.mkdir(mode=0o700, exist_ok=True)
        if os.geteuid() == 0:
            mounted = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(blobs)]
            )
            self.blob_mount = blobs if mounted.returncode == 0 else None
        ports = [free_port() for _ in range(self.servers)]
        self.urls = [f"http://127.0.0.1:{p}" for p in ports]
        for i, port in enumerate(ports):
            data = self.root / f"server-{i}"
            data.mkdir(mode=0o700, exist_ok=True)
            if i > 0:  # the replicas share the first one's keys and admin token
                for f in (self.root / "server-0").iterdir():
                    if f.is_file() and f.suffix not in (".db", ".log") and not f.name.startswith("pool"):
                        shutil.copy2(f, data / f.name)
            part = Part(
                f"server-{i}",
                cpool_argv(
                    "server",
                    "--data-dir",
                    str(data),
                    "--db",
                    self.pg.url,
                    "--port",
                    str(port),
                    "--heartbeat-s",
                    str(self.heartbeat_s),
                    "--suspect-s",
                    str(self.suspect_s),
                    "--lost-s",
                    str(self.lost_s),
                    "--api-rate",
                    "0",
                    "--auth-fail-rate",
                    "0",
                    "--blob-dir",
                    str(blobs),
                    "--ledger-interval",
                    "2",
                ),  # fmt: skip
                self.root / f"server-{i}.log",
            )
            self.parts[part.name] = part
            part.start(self.env)
            self.wait(f"{part.name} ready", functools.partial(self._ready, self.urls[i]), 90, part)
            if i == 0:
                self.admin_token = (data / "admin-token").read_text().strip()
        self.freezer.make(self.agents)
        join = self.call("POST", "/api/v1/join-tokens", json={"single_use": False})["token"]
        for i in range(self.agents):
            name = f"chaos{self.run_id}-{i}"
            data = self.root / f"agent-{i}"
            own, base = self.freezer.agent_cgroup(i), self.freezer.jobs_base(i)
            servers = [a for u in self.urls for a in ("--server", u)]
            part = Part(
                name,
                cpool_argv(
                    "agent",
                    *servers,
                    "--join-token",
                    join,
                    "--data-dir",
                    str(data),
                    "--name",
                    name,
                    "--simulate",
                    SIMULATE,
                    "--cgroup-base",
                    base,
                    "--kill-grace-s",
                    "2",
                ),  # fmt: skip
                self.root / f"agent-{i}.log",
                cgroup=own,
            )
            self.parts[name] = part
            part.start(self.env)
        self.wait("every node ready", lambda: len(self.ready_nodes()) == self.agents, 120)

    def _remove_node_cgroups(self) -> None:
        """The agents' own directories under the shared default base (`<controller>/computepool/
        chaos<run>-<i>-<agent id>`, v1 and hybrid hosts): each run's would pile up on the host."""
        if self.freezer.kind == "v2":
            return  # below the run's own cgroup, removed with it
        deadline = time.monotonic() + 15  # a killed job's last processes leave its cgroup just after
        for i in range(self.agents):
            for node_dir in CGROUP_ROOT.glob(f"*/computepool/chaos{self.run_id}-{i}-*"):
                dirs = sorted((q for q in node_dir.rglob("*") if q.is_dir()), key=lambda q: -len(q.parts))
                for d in [*dirs, node_dir]:
                    while True:
                        try:
                            d.rmdir()
                            break
                        except FileNotFoundError:
                            break
                        except OSError:
                            if time.monotonic() > deadline:
                                break
                            time.sleep(0.1)

    def close(self) -> None:
        for part in self.parts.values():
            part.kill()
        self.freezer.remove()
        for i in range(self.agents):  # jobs outside any cgroup of ours (no cgroup v2): by their dirs
            for p in psutil.process_iter(["cmdline"]):
                with contextlib.suppress(psutil.Error):
                    if str(self.root / f"agent-{i}") in " ".join(p.info["cmdline"] or []):
                        p.kill()
        self._remove_node_cgroups()
        with contextlib.suppress(Exception):
            self.pg.stop("immediate")
        if self.blob_mount is not None:
            subprocess.run(["umount", "-l", str(self.blob_mount)], capture_output=True)

    # ---- the API, through whichever replica answers ------------------------------------------
    def call(self, method: str, path: str, token: str | None = None, timeout: float = 15, **kw: Any) -> Any:
        """One API call, tried on each replica in turn while they refuse connections or answer 503."""
        last: Exception | None = None
        for url in self.urls:
            try:
                r = httpx.request(
                    method, url + path, headers={"Authorization": f"Bearer {token or self.admin_token}"},
                    timeout=timeout, **kw,
                )  # fmt: skip
            except httpx.TransportError as e:
                last = e
                continue
            if r.status_code == 503:
                last = RuntimeError(f"{url}: 503 {r.text[:200]}")
                continue
            if r.status_code >= 400:
                raise ApiRefused(r.status_code, r.text[:500])
            return r.json()
        raise ClusterError(f"no replica answered {method} {path}: {last}")

    @staticmethod
    def _ready(url: str) -> bool:
        try:
            return httpx.get(url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def roles(self) -> dict[str, str]:
        """Replica name → "leader" / "standby" / "down", as each one's /readyz says."""
        out = {}
        for i, url in enumerate(self.urls):
            try:
                r = httpx.get(url + "/readyz", timeout=1)
                out[f"server-{i}"] = (
                    str(r.json().get("scheduler", "down")) if r.status_code == 200 else "down"
                )
            except (httpx.HTTPError, ValueError):
                out[f"server-{i}"] = "down"
        return out

    def leader(self) -> str | None:
        return next((n for n, role in self.roles().items() if role == "leader"), None)

    def ready_nodes(self) -> list[str]:
        try:
            items = self.call("GET", "/api/v1/nodes", timeout=5)["items"]
        except (ClusterError, ApiRefused):
            return []
        return [n["name"] for n in items if n["state"] == "ready"]

    def wait(self, what: str, check: Callable[[], bool], timeout: float, part: Part | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline or (part is not None and not part.alive):
                detail = part.tail() if part is not None else ""
                raise ClusterError(f"timed out waiting for {what}\n{detail}")
            time.sleep(0.2)

    # ---- faults ------------------------------------------------------------------------------
    def agents_(self) -> list[Part]:
        return [p for n, p in self.parts.items() if not n.startswith("server-")]

    def freeze_node(self, part: Part) -> None:
        """The agent, its supervisors and its jobs, all stopped at once."""
        if part.cgroup is not None:
            self.freezer.freeze(part.cgroup, True)
        else:
            for p in self._tree(part):
                with contextlib.suppress(psutil.Error):
                    p.suspend()
        part.frozen = True

    def thaw_node(self, part: Part) -> None:
        if part.cgroup is not None:
            self.freezer.freeze(part.cgroup, False)
        else:
            for p in self._tree(part):
                with contextlib.suppress(psutil.Error):
                    p.resume()
        part.frozen = False

    @staticmethod
    def _tree(part: Part) -> list[psutil.Process]:
        if part.proc is None:
            return []
        try:
            me = psutil.Process(part.proc.pid)
            return [me, *me.children(recursive=True)]
        except psutil.Error:
            return []

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(1500)}" for p in self.parts.values())


class ApiRefused(RuntimeError):
    """The API answered 4xx/5xx (not 503): status and body."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body}")
        self.status, self.body = status, body


class NodeFreezer:
    """A freezer cgroup per node of the run (see the module); `kind` None: none could be made."""

    def __init__(self, name: str) -> None:
        self.kind: str | None = None
        if (CGROUP_ROOT / "cgroup.controllers").is_file():
            self.kind, self.root = "v2", CGROUP_ROOT / name
        elif (CGROUP_ROOT / "freezer" / "freezer.state").exists() or (CGROUP_ROOT / "freezer").is_dir():
            self.kind, self.root = "v1", CGROUP_ROOT / "freezer" / name
        else:
            self.root = CGROUP_ROOT / name

    def make(self, nodes: int) -> None:
        try:
            if self.kind == "v2":
                self.root.mkdir()
                (self.root / "cgroup.subtree_control").write_text("+cpu +memory +pids")
                for i in range(nodes):
                    (self.root / f"node-{i}").mkdir()
                    (self.root / f"node-{i}" / "cgroup.subtree_control").write_text("+cpu +memory +pids")
                    (self.root / f"node-{i}" / "agent").mkdir()
            elif self.kind == "v1":
                self.root.mkdir()
                for i in range(nodes):
                    (self.root / f"node-{i}").mkdir()
        except OSError:
            self.remove()
            self.kind = None

    def agent_cgroup(self, i: int) -> Path | None:
        if self.kind == "v2":
            return self.root / f"node-{i}" / "agent"
        return self.root / f"node-{i}" if self.kind == "v1" else None

    def jobs_base(self, i: int) -> str:
        """The agent's --cgroup-base: below the node's cgroup on v2, the agent's default else."""
        return str(self.root / f"node-{i}" / "jobs") if self.kind == "v2" else "/sys/fs/cgroup/computepool"

    def freeze(self, agent_cgroup: Path, frozen: bool) -> None:
        if self.kind == "v2":
            (agent_cgroup.parent / "cgroup.freeze").write_text("1" if frozen else "0")
        elif self.kind == "v1":
            (agent_cgroup / "freezer.state").write_text("FROZEN" if frozen else "THAWED")

    def remove(self) -> None:
        """Thaw, kill what is left inside, remove the cgroups."""
        if self.kind is None or not self.root.is_dir():
            return
        dirs = sorted(
            (p for p in self.root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
        )
        for d in [*dirs, self.root]:
            with contextlib.suppress(OSError):
                if self.kind == "v2":
                    (d / "cgroup.freeze").write_text("0")
                    (d / "cgroup.kill").write_text("1")
                else:
                    (d / "freezer.state").write_text("THAWED")
                    for pid in (d / "cgroup.procs").read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 20
        for d in [*dirs, self.root]:
            while d.is_dir():
                try:
                    d.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
