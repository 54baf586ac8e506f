"""`cpool bench jobs`: what a tiny job costs on a pool of one's own, and Slurm side by side.

The bench starts `cpool up --simulate 1xA100-80GB` (temp dir, free loopback port) and measures:
- e2e: the wall time of `cpool run --no-code --cpus 0.1 -- true` as a subprocess, idle pool;
- cli_submit: the same with `-d` (submit and return);
- throughput: `jobs` jobs of `true` submitted through the API, each 1/`slots` of the node's CPUs
  (so `slots` run at once), then drained: jobs / (first submit → none left live, polled);
- daemon CPU: the server's and agent's own CPU time (user + system) over the throughput run; the
  jobs and their launchers (children the agent reaps) are `job_side_cpu_s_per_100_jobs`;
- agent idle CPU over an idle window, scaled to a minute;
- after_20k: the e2e p50 and agent idle CPU again once the agent has run `history` jobs (filled
  through the API, many small jobs in flight, in batches).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from computepool.client.aio import AioApi
from computepool.client.bench import percentile
from computepool.client.bench_pool import LocalProcess
from computepool.client.errors import PoolError, ServerUnreachable

LIVE = ("pending", "bound", "active")
SUBMIT_CONNECTIONS = 16
E2E_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class JobsSuite:
    jobs: int = 500
    samples: int = 20
    history: int = 20_000
    history_batch: int = 1000
    history_slots: int = 20
    history_max_s: float | None = None  # stop filling (between batches) after this long
    idle_s: float = 20.0
    slots: int = 20
    poll_s: float = 0.25
    drain_timeout_s: float = 900.0
    slurm: bool = True
    slurm_defaults: bool = True  # also Slurm with its default SchedulerParameters


def cpool_argv() -> list[str]:
    """The `cpool` users run: the console script beside this Python, else `python -m`."""
    script = Path(sys.executable).with_name("cpool")
    if script.exists():
        return [str(script)]
    found = shutil.which("cpool")
    return [found] if found else [sys.executable, "-m", "computepool.cli.main"]


@dataclass
class _Daemons:
    server: psutil.Process
    agent: psutil.Process

    @classmethod
    def of(cls, local: LocalProcess) -> _Daemons:
        assert local.proc is not None
        found: dict[str, psutil.Process] = {}
        for child in psutil.Process(local.proc.pid).children():
            argv = child.cmdline()
            if "computepool.cli.main" in argv:
                found[argv[argv.index("computepool.cli.main") + 1]] = child
        if "server" not in found or "agent" not in found:
            raise RuntimeError(f"`cpool up` has no server and agent children: {sorted(found)}")
        return cls(found["server"], found["agent"])

    @staticmethod
    def own(p: psutil.Process) -> float:
        t = p.cpu_times()
        return float(t.user + t.system)

    @staticmethod
    def reaped(p: psutil.Process) -> float:
        t = p.cpu_times()
        return float(t.children_user + t.children_system)

    def cpu(self) -> tuple[float, float, float]:
        """(server own, agent own, agent's reaped children) CPU seconds."""
        return self.own(self.server), self.own(self.agent), self.reaped(self.agent)


def _timed_cli(argv: list[str], env: dict[str, str], samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        r = subprocess.run(
            argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=E2E_TIMEOUT_S
        )
        took = (time.perf_counter() - t0) * 1000
        if r.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv[-7:])}` exited {r.returncode}: {r.stderr.strip()[-300:]}")
        out.append(took)
    return out


async def _live(api: AioApi) -> bool:
    """Whether some job is still live (the bench's pool is its own). States are asked in turn,
    pending first, and the first that holds one answers: while work waits, a poll is one cheap
    request, so the poll itself adds little to the server CPU measured."""
    for st in LIVE:
        if (await api.call("GET", "/allocations", params={"state": st, "limit": "1"}))["items"]:
            return True
    return False


async def _drain(api: AioApi, s: JobsSuite) -> float:
    deadline = time.monotonic() + s.drain_timeout_s
    while await _live(api):
        if time.monotonic() > deadline:
            raise RuntimeError(f"jobs still live after {s.drain_timeout_s:g} s")
        await asyncio.sleep(s.poll_s)
    return time.perf_counter()


async def _submit(api: AioApi, count: int, cpu_milli: int, errors: list[str]) -> None:
    body = {"name": "bench", "gpus": 0, "cpu_milli": cpu_milli, "memory_mib": 64, "command": ["true"]}
    sem = asyncio.Semaphore(SUBMIT_CONNECTIONS)

    async def one() -> None:
        async with sem:
            try:
                await api.call("POST", "/allocations", body, {"Idempotency-Key": uuid.uuid4().hex})
            except (PoolError, ServerUnreachable) as e:
                errors.append(f"submit: {e}")

    await asyncio.gather(*(one() for _ in range(count)))


async def _ended_badly(api: AioApi, errors: list[str]) -> int:
    items = (await api.call("GET", "/allocations", params={"limit": "10000"}))["items"]
    bad = [a for a in items if a.get("state") != "released"]
    errors += [f"job {a['id']} {a.get('state')}: {a.get('reason')}" for a in bad[:5]]
    return len(bad)


async def _throughput(local: LocalProcess, d: _Daemons, s: JobsSuite, node_cpu_milli: int) -> dict[str, Any]:
    errors: list[str] = []
    async with AioApi(local.url, local.token, SUBMIT_CONNECTIONS + 4, 60.0) as api:
        await _drain(api, s)
        srv0, ag0, kids0 = d.cpu()
        t0 = time.perf_counter()
        await _submit(api, s.jobs, max(1, node_cpu_milli // s.slots), errors)
        submitted = time.perf_counter()
        drained = await _drain(api, s)
        srv1, ag1, kids1 = d.cpu()
        failed = await _ended_badly(api, errors)
    span = drained - t0
    per100 = 100 / s.jobs
    return {
        "jobs_per_s": round(s.jobs / span, 2) if span > 0 else None,
        "daemon_cpu_s_per_100_jobs": round((srv1 - srv0 + ag1 - ag0) * per100, 3),
        "server_cpu_s_per_100_jobs": round((srv1 - srv0) * per100, 3),
        "agent_cpu_s_per_100_jobs": round((ag1 - ag0) * per100, 3),
        "job_side_cpu_s_per_100_jobs": round((kids1 - kids0) * per100, 3),
        "submit_s": round(submitted - t0, 3),
        "failed": failed + len(errors),
        "error_samples": errors[:5],
    }


async def _fill_history(local: LocalProcess, s: JobsSuite, node_cpu_milli: int, have: int) -> dict[str, Any]:
    """Run jobs until the agent has run `history` in all: batches of `history_batch`, each drained;
    with `history_max_s`, no batch starts after that long (`jobs` then says how many it reached)."""
    errors: list[str] = []
    todo = max(0, s.history - have)
    filled = 0
    t0 = time.perf_counter()
    async with AioApi(local.url, local.token, SUBMIT_CONNECTIONS + 4, 60.0) as api:
        while filled < todo:
            if s.history_max_s is not None and time.perf_counter() - t0 > s.history_max_s:
                break
            batch = min(todo - filled, s.history_batch)
            await _submit(api, batch, max(1, node_cpu_milli // s.history_slots), errors)
            await _drain(api, s)
            filled += batch
    took = time.perf_counter() - t0
    return {
        "jobs": have + filled,
        "asked": s.history,
        "how": f"{have} jobs of the runs before, then {filled} `true` jobs through the API in "
        f"batches of {s.history_batch}, {s.history_slots} running at once, each batch drained",
        "fill_s": round(took, 1),
        "fill_jobs_per_s": round(filled / took, 2) if took > 0 and filled else None,
        "submit_errors": len(errors),
    }


async def _node_cpu_milli(local: LocalProcess) -> int:
    async with AioApi(local.url, local.token, 2, 30.0) as api:
        nodes = (await api.call("GET", "/nodes"))["items"]
    return int(nodes[0]["cpu_milli"])


async def _count_jobs(local: LocalProcess) -> int:
    async with AioApi(local.url, local.token, 2, 60.0) as api:
        return len((await api.call("GET", "/allocations", params={"limit": "10000"}))["items"])


def _idle_cpu_per_min(d: _Daemons, idle_s: float) -> tuple[float, float]:
    """(agent, server) own CPU seconds per minute over `idle_s` of an idle pool."""
    a0, s0 = d.own(d.agent), d.own(d.server)
    t0 = time.monotonic()
    time.sleep(idle_s)
    wall = time.monotonic() - t0
    return (
        round((d.own(d.agent) - a0) * 60 / wall, 3),
        round((d.own(d.server) - s0) * 60 / wall, 3),
    )


def _e2e_and_idle(d: _Daemons, env: dict[str, str], s: JobsSuite) -> dict[str, Any]:
    e2e = _timed_cli([*cpool_argv(), "run", "--no-code", "--cpus", "0.1", "--", "true"], env, s.samples)
    agent_idle, server_idle = _idle_cpu_per_min(d, s.idle_s)
    return {
        "e2e_p50_ms": percentile(e2e, 50),
        "e2e_p99_ms": percentile(e2e, 99),
        "agent_idle_cpu_s_per_min": agent_idle,
        "server_idle_cpu_s_per_min": server_idle,
    }


def run_jobs_suite(s: JobsSuite, say: Callable[[str], None]) -> dict[str, Any]:
    """The whole suite; returns the figures `cpool bench jobs --json` prints."""
    with LocalProcess("up") as local:
        d = _Daemons.of(local)
        env = {k: v for k, v in os.environ.items() if k != "CPOOL_CA"}  # plain http: no CA
        env |= {"CPOOL_SERVER": local.url, "CPOOL_TOKEN": local.token}
        cpu_milli = asyncio.run(_node_cpu_milli(local))
        say(f"pool up at {local.url}; e2e ×{s.samples} and {s.idle_s:g} s idle …")
        first = _e2e_and_idle(d, env, s)
        say("cli submit …")
        submit = _timed_cli(
            [*cpool_argv(), "run", "-d", "--no-code", "--cpus", "0.1", "--", "true"], env, s.samples
        )
        say(f"{s.jobs} jobs on {s.slots} slots …")
        thr = asyncio.run(_throughput(local, d, s, cpu_milli))
        have = asyncio.run(_count_jobs(local))
        say(f"filling the agent's history to {s.history} jobs …")
        after: dict[str, Any] = {}
        try:  # a failure this late keeps the figures already taken
            hist = asyncio.run(_fill_history(local, s, cpu_milli, have))
            say(f"e2e ×{s.samples} and {s.idle_s:g} s idle again …")
            after = _e2e_and_idle(d, env, s)
        except (RuntimeError, PoolError, ServerUnreachable, subprocess.TimeoutExpired) as e:
            hist = {"jobs": None, "error": str(e)}
    out: dict[str, Any] = {
        "e2e_p50_ms": first["e2e_p50_ms"],
        "e2e_p99_ms": first["e2e_p99_ms"],
        "jobs_per_s": thr["jobs_per_s"],
        "cli_submit_ms": percentile(submit, 50),
        "daemon_cpu_s_per_100_jobs": thr["daemon_cpu_s_per_100_jobs"],
        "agent_idle_cpu_s_per_min": first["agent_idle_cpu_s_per_min"],
        "slurm": None,
        "after_20k": {
            "e2e_p50_ms": after.get("e2e_p50_ms"),
            "agent_idle_cpu_s_per_min": after.get("agent_idle_cpu_s_per_min"),
            "server_idle_cpu_s_per_min": after.get("server_idle_cpu_s_per_min"),
            "history": hist,
        },
        "detail": {
            "cli_submit_p99_ms": percentile(submit, 99),
            "server_idle_cpu_s_per_min": first["server_idle_cpu_s_per_min"],
            **{k: v for k, v in thr.items() if k not in ("jobs_per_s", "daemon_cpu_s_per_100_jobs")},
            "jobs": s.jobs,
            "slots": s.slots,
            "samples": s.samples,
            "idle_s": s.idle_s,
            "cpu_milli_per_job": max(1, cpu_milli // s.slots),
        },
    }
    if s.slurm:
        try:
            out["slurm"] = _slurm(s, say)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:  # the pool's figures stand
            out["slurm_error"] = str(e)
    return out


def _slurm(s: JobsSuite, say: Callable[[str], None]) -> dict[str, Any] | None:
    from computepool.client.bench_slurm import SlurmSettings, run_slurm_bench, slurm_available

    if not slurm_available():
        return None
    say("Slurm: a private cluster (batch_sched_delay=0) …")
    st = SlurmSettings(jobs=s.jobs, samples=s.samples, slots=s.slots, poll_s=s.poll_s)
    tuned = run_slurm_bench(st)
    if not s.slurm_defaults:
        return tuned
    say("Slurm: again with its default scheduler parameters …")
    try:
        default = run_slurm_bench(dataclasses.replace(st, scheduler_parameters=None))
    except RuntimeError as e:  # the tuned figures stand on their own
        tuned["default_scheduler"] = {"error": str(e)}
    else:
        keys = ("e2e_p50_ms", "jobs_per_s", "daemon_cpu_s_per_100_jobs")
        tuned["default_scheduler"] = {k: default[k] for k in keys}
    return tuned
