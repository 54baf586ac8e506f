"""`cpool bench starts` and `cpool bench agents`: whole-pool benchmarks against a live control plane.

`run_jobs_bench` submits short CPU-only jobs (gpus=0, so they never queue behind GPU capacity),
at most `concurrency` in flight, and times each from submit to `started_at` (server clock:
`created_at` → `started_at`) and from submit to ended (client clock, polled). With an image the
jobs are containers; since the agent reports a job started when it has launched it, not when the
workload's first instruction runs, each job also prints the time it began and
`workload_start_*` is `created_at` → that time (one clock when the pool runs on this machine).

`run_agents_bench` joins `count` simulated nodes (one device each) and heartbeats each of them
every `interval_s`, the nodes spread evenly over the interval, timing how late every beat is. No beat
is sent after `seconds`: the ones still queued then (an overloaded server) count as missed.

`LocalProcess` starts `cpool up` / `cpool server` on a free loopback port in a temp data dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from computepool.client.aio import AioApi
from computepool.client.bench import percentile
from computepool.client.errors import PoolError, ServerUnreachable
from computepool.client.http import ENDED_STATES

MAX_ERROR_SAMPLES = 5
AGENT_PREFIX = "bench-agent-"
JOIN_CONCURRENCY = 32
READY_TIMEOUT_S = 60.0


# -- local processes -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalProcess:
    """`cpool up --simulate …` or `cpool server` on 127.0.0.1:<free port>, in a temp data dir."""

    def __init__(self, kind: str, simulate: str = "1xA100-80GB") -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix=f"cpool-bench-{kind}-")
        self.data_dir = Path(self._tmp.name)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kind = kind
        args = ["--data-dir", str(self.data_dir), "--host", "127.0.0.1", "--port", str(self.port)]
        if kind == "up":
            args += ["--simulate", simulate, "--no-tls"]  # plain http on loopback: figures stay comparable
        self.argv = [sys.executable, "-m", "computepool.cli.main", kind, *args]
        self.log_path = self.data_dir / f"bench-{kind}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ)
        for k in ("CPOOL_JOIN_TOKEN", "CPOOL_DATA_DIR", "CPOOL_AGENT_DIR", "CPOOL_SERVER", "CPOOL_TOKEN"):
            env.pop(k, None)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )

    @property
    def token(self) -> str:
        return (self.data_dir / "admin-token").read_text().strip()

    def _tail(self) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1] if lines else ""

    def wait_ready(self, need_ready_node: bool, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until /readyz answers and the admin token exists (and, for `up`, a node is ready)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"`cpool {self.kind}` exited ({self.proc.returncode}): {self._tail()}")
            with contextlib.suppress(httpx.HTTPError, OSError, KeyError, ValueError):
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    token = self.token
                    if not need_ready_node:
                        return
                    r = httpx.get(
                        f"{self.url}/api/v1/nodes", headers={"Authorization": f"Bearer {token}"}, timeout=5
                    )
                    if any(n.get("state") == "ready" for n in r.json()["items"]):
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"`cpool {self.kind}` not ready after {timeout_s:.0f} s: {self._tail()}")
            time.sleep(0.2)

    def server_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.kind == "server" else None

    def stop(self) -> None:
        """SIGTERM (then SIGINT, the force quit of open long polls), SIGKILL after 30 s; remove the dir."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=25)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        with contextlib.suppress(OSError):
            self._tmp.cleanup()

    def __enter__(self) -> LocalProcess:
        self.start()
        try:
            self.wait_ready(need_ready_node=self.kind == "up")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- shared ----------------------------------------------------------------------------------


@dataclass
class _Errors:
    count: int = 0
    samples: list[str] = field(default_factory=list)

    def add(self, what: str) -> None:
        self.count += 1
        if len(self.samples) < MAX_ERROR_SAMPLES:
            self.samples.append(what)


def _ts(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


# -- bench jobs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobsSettings:
    server: str
    token: str
    count: int = 200
    concurrency: int = 10
    cpu_milli: int = 100
    job_timeout_s: float = 60.0
    poll_max_s: float = 10.0  # each long-poll answers as soon as the state changes
    http_timeout_s: float = 30.0
    hold_s: float = 0.0  # each job sleeps this long (0: it exits at once)
    image: str | None = None  # run each job in a container of this image (it needs python3 and sh)


def _job_command(hold_s: float, image: str | None = None) -> list[str]:
    """Print the wall-clock time the workload began, then end (or sleep `hold_s`)."""
    if hold_s <= 0:
        return ["python3", "-c", "import time; print(time.time())"]  # the node's, on the job's PATH
    # far lighter than a Python per job when a hundred run at once
    return ["sh" if image else shutil.which("sh") or "/bin/sh", "-c", f"date +%s.%N; exec sleep {hold_s:g}"]


def peak_overlap(spans: list[tuple[datetime, datetime]]) -> int:
    """The most spans open at one instant (an end at t closes before a start at t opens)."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    peak = cur = 0
    for _, step in edges:
        cur += step
        peak = max(peak, cur)
    return peak


async def _one_job(
    api: AioApi,
    s: JobsSettings,
    start_ms: list[float],
    e2e_ms: list[float],
    err: _Errors,
    spans: list[tuple[datetime, datetime]],
    began: list[tuple[str, datetime]],
) -> None:
    body: dict[str, Any] = {
        "name": "bench-job",
        "gpus": 0,
        "cpu_milli": s.cpu_milli,
        "command": _job_command(s.hold_s, s.image),
    }
    if s.image:
        body["image"] = s.image
    t0 = time.perf_counter()
    try:
        alloc = await api.call("POST", "/allocations", body, {"Idempotency-Key": uuid.uuid4().hex})
    except (PoolError, ServerUnreachable) as e:
        err.add(f"submit: {e}")
        return
    alloc_id = alloc["id"]
    deadline = time.monotonic() + s.job_timeout_s
    try:
        while alloc.get("state") not in ENDED_STATES and time.monotonic() < deadline:
            wait = round(min(s.poll_max_s, max(0.0, deadline - time.monotonic())), 3)
            params = {"wait": str(wait), "state": str(alloc.get("state"))}  # answers on the next change
            alloc = await api.call("GET", f"/allocations/{alloc_id}", params=params)
    except (PoolError, ServerUnreachable) as e:
        err.add(f"job {alloc_id}: {e}")
        return
    ended = time.perf_counter()
    state = alloc.get("state")
    if state not in ENDED_STATES:
        err.add(f"job {alloc_id} still {state} after {s.job_timeout_s:g} s")
        with contextlib.suppress(PoolError, ServerUnreachable):
            await api.call("POST", f"/allocations/{alloc_id}/cancel")
        return
    if state != "released":
        err.add(f"job {alloc_id} ended {state}: {alloc.get('reason')}")
        return
    created, started = _ts(alloc.get("created_at")), _ts(alloc.get("started_at"))
    if created is None or started is None:
        err.add(f"job {alloc_id} has no created_at/started_at")
        return
    start_ms.append((started - created).total_seconds() * 1000)
    e2e_ms.append((ended - t0) * 1000)
    began.append((str(alloc_id), created))
    finished = _ts(alloc.get("ended_at"))
    if finished is not None:
        spans.append((started, finished))


async def _workload_starts(
    api: AioApi, began: list[tuple[str, datetime]], sem: asyncio.Semaphore
) -> list[float]:
    """created_at → the time each job printed as its first line (read after the timed run)."""

    async def one(alloc_id: str, created: datetime) -> float | None:
        async with sem:
            for _ in range(3):  # the last output may still be on its way from the agent
                with contextlib.suppress(PoolError, ServerUnreachable):
                    out = await api.call("GET", f"/allocations/{alloc_id}/logs", params={"wait": "2"})
                    first = str((out.get("stdout") or {}).get("data") or "").split("\n", 1)[0].strip()
                    with contextlib.suppress(ValueError):
                        return (float(first) - created.timestamp()) * 1000
                await asyncio.sleep(0.5)
        return None

    got = await asyncio.gather(*(one(a, c) for a, c in began))
    return [ms for ms in got if ms is not None]


async def run_jobs_bench(s: JobsSettings) -> dict[str, Any]:
    """Submit `count` short jobs, `concurrency` in flight; returns the figures `--json` prints."""
    start_ms: list[float] = []
    e2e_ms: list[float] = []
    err = _Errors()
    spans: list[tuple[datetime, datetime]] = []
    began: list[tuple[str, datetime]] = []
    sem = asyncio.Semaphore(s.concurrency)

    async with AioApi(s.server, s.token, s.concurrency + 4, s.http_timeout_s) as api:

        async def slot() -> None:
            async with sem:
                await _one_job(api, s, start_ms, e2e_ms, err, spans, began)

        t0 = time.monotonic()
        await asyncio.gather(*(slot() for _ in range(s.count)))
        elapsed = time.monotonic() - t0
        workload_ms = await _workload_starts(api, began, sem)
    return {
        "executor": "container" if s.image else "process",
        "image": s.image,
        "start_latency_p50_ms": percentile(start_ms, 50),
        "start_latency_p99_ms": percentile(start_ms, 99),
        "workload_start_p50_ms": percentile(workload_ms, 50),
        "workload_start_p99_ms": percentile(workload_ms, 99),
        "end_to_end_p50_ms": percentile(e2e_ms, 50),
        "end_to_end_p99_ms": percentile(e2e_ms, 99),
        "jobs": s.count,
        "completed": len(e2e_ms),
        "failed": err.count,
        "concurrency": s.concurrency,
        "peak_running": peak_overlap(spans),
        "hold_s": s.hold_s,
        "gpus_per_job": 0,
        "cpu_milli_per_job": s.cpu_milli,
        "elapsed_s": round(elapsed, 3),
        "jobs_per_s": round(len(e2e_ms) / elapsed, 2) if elapsed > 0 else 0.0,
        "error_samples": err.samples,
    }


# -- bench agents ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentsSettings:
    server: str
    token: str
    count: int = 1000
    seconds: float = 60.0
    interval_s: float = 5.0
    keep_nodes: bool = False
    server_pid: int | None = None
    connections: int = 100
    join_concurrency: int = JOIN_CONCURRENCY
    http_timeout_s: float = 30.0


# what an agent reports with each beat: its device's memory in use and utilisation
_BEAT = {"devices_usage": [{"index": 0, "used_memory_mib": 1024, "utilization_pct": 50.0}]}


def _node_body(join_token: str, name: str) -> dict[str, Any]:
    device = {
        "index": 0,
        "vendor": "nvidia",
        "model": "A100-80GB",
        "memory_mib": 80 * 1024,
        "uuid": f"GPU-{name}-0",
        "link_group": "nvl0",
    }
    return {
        "join_token": join_token,
        "name": name,
        "cpu_milli": 8000,
        "memory_mib": 64 * 1024,
        "labels": {"bench": "agents"},
        "devices": [device],
    }


class _CpuMeter:
    """The server process's CPU use (user + system, children included) over a span, in percent."""

    def __init__(self, pid: int | None) -> None:
        self.proc: psutil.Process | None = None
        self.t0 = 0.0
        self.cpu0 = 0.0
        if pid is not None:
            with contextlib.suppress(psutil.Error):
                self.proc = psutil.Process(pid)

    def _cpu(self) -> float:
        assert self.proc is not None
        t = self.proc.cpu_times()
        return float(t.user + t.system + t.children_user + t.children_system)

    def start(self) -> None:
        if self.proc is not None:
            try:
                self.cpu0, self.t0 = self._cpu(), time.monotonic()
            except psutil.Error:
                self.proc = None

    def stop(self) -> float | None:
        if self.proc is None:
            return None
        try:
            used = self._cpu() - self.cpu0
        except psutil.Error:
            return None
        wall = time.monotonic() - self.t0
        return round(100 * used / wall, 1) if wall > 0 else None


async def run_agents_bench(s: AgentsSettings) -> dict[str, Any]:
    """Join `count` simulated nodes and heartbeat them; returns the figures `--json` prints."""
    names = [f"{AGENT_PREFIX}{i:04d}" for i in range(s.count)]
    lag_ms: list[float] = []
    err = _Errors()
    join_err = _Errors()
    missed = [0]  # beats never sent: still queued behind slow answers when the run ended
    joined: dict[str, str] = {}
    meter = _CpuMeter(s.server_pid)
    t_join = 0.0
    ready_at_end = 0
    elapsed = 0.0
    cpu: float | None = None
    async with AioApi(s.server, s.token, max(s.connections, s.join_concurrency) + 4, s.http_timeout_s) as api:
        existing = {n["name"] for n in (await api.call("GET", "/nodes"))["items"]}
        clash = sorted(existing.intersection(names))
        if clash:
            raise PoolError(
                409,
                f"{len(clash)} nodes named {AGENT_PREFIX}* exist already (e.g. {clash[0]}): delete them",
            )
        jt = await api.call("POST", "/join-tokens", {"expires_in_s": 3600, "single_use": False})
        sem = asyncio.Semaphore(s.join_concurrency)

        async def join(name: str) -> None:
            async with sem:
                try:
                    out = await api.call("POST", "/nodes/join", _node_body(jt["token"], name))
                except (PoolError, ServerUnreachable) as e:
                    join_err.add(f"join {name}: {e}")
                    return
                joined[name] = str(out["credential"])

        try:
            t = time.monotonic()
            await asyncio.gather(*(join(n) for n in names))
            t_join = time.monotonic() - t

            beat_sem = asyncio.Semaphore(s.connections)
            beats = max(1, math.ceil(s.seconds / s.interval_s))
            order = [n for n in names if n in joined]
            meter.start()
            t0 = time.monotonic()
            end = t0 + s.seconds

            async def agent(i: int, name: str) -> None:
                headers = {"Authorization": f"Bearer {joined[name]}"}
                offset = s.interval_s * i / max(1, len(order))
                for k in range(beats):
                    scheduled = t0 + offset + k * s.interval_s
                    if scheduled >= end:
                        return
                    await asyncio.sleep(max(0.0, scheduled - time.monotonic()))
                    try:
                        async with beat_sem:
                            if time.monotonic() >= end:  # the run is over: what is still queued is missed
                                missed[0] += sum(
                                    1 for j in range(k, beats) if offset + j * s.interval_s < s.seconds
                                )
                                return
                            await api.call("POST", f"/nodes/{name}/heartbeat", _BEAT, headers)
                    except (PoolError, ServerUnreachable) as e:
                        err.add(f"heartbeat {name}: {e}")
                        continue
                    lag_ms.append((time.monotonic() - scheduled) * 1000)

            await asyncio.gather(*(agent(i, n) for i, n in enumerate(order)))
            elapsed = time.monotonic() - t0
            cpu = meter.stop()
            nodes = (await api.call("GET", "/nodes"))["items"]
            ready_at_end = sum(1 for n in nodes if n.get("name") in joined and n.get("state") == "ready")
        finally:
            if not s.keep_nodes:
                dsem = asyncio.Semaphore(s.join_concurrency)

                async def delete(name: str) -> None:
                    async with dsem:
                        with contextlib.suppress(PoolError, ServerUnreachable):
                            await api.call("DELETE", f"/nodes/{name}")

                await asyncio.gather(*(delete(n) for n in joined))
    return {
        "heartbeat_lag_p50_ms": percentile(lag_ms, 50),
        "heartbeat_lag_p99_ms": percentile(lag_ms, 99),
        "heartbeat_lag_max_ms": round(max(lag_ms), 3) if lag_ms else None,
        "heartbeats": len(lag_ms),
        "heartbeats_missed": missed[0],
        "errors": err.count + join_err.count,
        "join_errors": join_err.count,
        "nodes_ready_at_end": ready_at_end,
        "server_cpu_pct": cpu,
        "agents": s.count,
        "agents_joined": len(joined),
        "join_s": round(t_join, 3),
        "seconds": s.seconds,
        "interval_s": s.interval_s,
        "elapsed_s": round(elapsed, 3),
        "heartbeats_per_s": round(len(lag_ms) / elapsed, 2) if elapsed > 0 else 0.0,
        "error_samples": err.samples + join_err.samples,
    }
