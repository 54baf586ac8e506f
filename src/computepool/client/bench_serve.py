"""`cpool bench serve`: one model service on dedicated devices (static) against the same service
elastic on a shared pool (pooled), both fed the same day-shaped trace through the gateway.

The bench starts its own pool: a `cpool server` and `nodes` agents with simulated GPUs on
loopback, two tenants (`inference`, whose quota guarantees the peak's replicas, and `batch`, with
no quota, so everything it holds is borrowed and preemptible) and ships the stdlib engine
(serving/simengine.py) as the replicas' code. Each arm:

1. puts the service (static: min = max = the peak's replicas; pooled: min..max, autoscaled) and
   waits for its first replicas to answer their health check;
2. keeps a backlog of restartable one-GPU batch jobs of `batch` pending, which take whatever the
   service leaves free (static: the devices beyond its replicas; pooled: everything it is not
   using, given back by preemption at the peaks);
3. replays the trace's arrivals (open loop: each request is sent at its time, whatever the others
   do) at `/v1/completions`, timing each as the client sees it;
4. reads the allocations back: GPU-hours held by the service's replicas (device share × bound
   time, clipped to the day) and batch work completed in the day, both in trace hours.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from computepool.client.aio import AioApi
from computepool.client.archive import pack
from computepool.client.bench import percentile
from computepool.client.bench_pool import LocalProcess
from computepool.client.errors import PoolError, ServerUnreachable
from computepool.client.http import ENDED_STATES, PoolClient
from computepool.serving.trace import DayTrace

INFERENCE, BATCH = "inference", "batch"
DEVICE = "A100-80GB"
PROMPT = "tell me how a pool of shared cards serves a day of requests"  # 12 engine tokens
MAX_ERROR_SAMPLES = 5
READY_TIMEOUT_S = 180.0
SETTLE_TIMEOUT_S = 90.0
SLEEP = shutil.which("sleep") or "/bin/sleep"
Say = Callable[[str], None]


@dataclass(frozen=True)
class ServeBenchSettings:
    seed: int = 7
    day_s: float = 120.0
    peak_rps: float = 6.0
    gpus: int = 4
    nodes: int = 2
    replicas: int | None = None  # the peak's replicas (static's fixed size, pooled's max); default: sized
    slots: int = 2  # requests one engine works on at once
    ms_per_token: float = 50.0
    max_tokens: int = 16
    target_inflight: int = 2  # pooled: requests in flight (and queued) per replica the autoscaler aims at
    min_replicas: int = 1  # pooled
    scale_down_delay_s: int = 5  # pooled
    batch_job_hours: float = 1.0  # one batch job's length in trace hours, on one GPU
    prefill_s: float = 3.0  # batch fills the free devices this long before the day starts

    def __post_init__(self) -> None:
        if self.gpus % self.nodes:
            raise ValueError(f"gpus: {self.gpus} devices do not split evenly over {self.nodes} nodes")
        if self.replicas is not None and not 1 <= self.replicas <= self.gpus:
            raise ValueError(f"replicas: between 1 and gpus ({self.gpus}), got {self.replicas}")

    @property
    def trace(self) -> DayTrace:
        return DayTrace(seed=self.seed, day_s=self.day_s, peak_rps=self.peak_rps)

    @property
    def service_s(self) -> float:
        """One request's time on an idle engine: prefill (a tenth per prompt token) + completion."""
        return (0.1 * len(PROMPT.split()) + self.max_tokens) * self.ms_per_token / 1000

    @property
    def peak_replicas(self) -> int:
        """Enough engines for the peak's requests in flight (Little's law), within the pool."""
        if self.replicas is not None:
            return self.replicas
        need = math.ceil(self.peak_rps * self.service_s / self.slots)
        return max(1, min(self.gpus, need))


@dataclass
class _Arm:
    name: str
    min_replicas: int
    max_replicas: int
    target_inflight: int
    scale_down_delay_s: int


@dataclass
class _Replay:
    latency_ms: list[float] = field(default_factory=list)
    failed: int = 0
    samples: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.failed += 1
        if len(self.samples) < MAX_ERROR_SAMPLES:
            self.samples.append(what)


# -- the pool ----------------------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    for k in ("CPOOL_JOIN_TOKEN", "CPOOL_DATA_DIR", "CPOOL_AGENT_DIR", "CPOOL_SERVER", "CPOOL_TOKEN"):
        env.pop(k, None)
    return env


class _Server(LocalProcess):
    """`cpool server` in a session of its own: a Ctrl-C reaches the bench alone, which then ends
    the jobs before it stops the agents and the server (agents leave running jobs behind)."""

    def start(self) -> None:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=_child_env(), start_new_session=True,
            )  # fmt: skip


@contextlib.contextmanager
def _pool(s: ServeBenchSettings, say: Say) -> Iterator[tuple[LocalProcess, PoolClient]]:
    """A server on a free loopback port with its own service port range, and `nodes` agents."""
    server = _Server("server")
    base = 20000 + 100 * secrets.randbelow(100)  # below the ephemeral range; apart from other pools
    server.argv += ["--service-ports", f"{base}-{base + 99}", "--publish-ports", "30000-30999"]  # apart
    agents: list[subprocess.Popen[bytes]] = []
    say(f"starting a server and {s.nodes} agents × {s.gpus // s.nodes} simulated {DEVICE} …")
    with server, PoolClient(server.url, server.token) as admin:
        try:
            suffix = secrets.token_hex(2)
            for i in range(s.nodes):
                env = _child_env()
                env["CPOOL_JOIN_TOKEN"] = str(admin.create_join_token(600, single_use=True)["token"])
                argv = [sys.executable, "-m", "computepool.cli.main", "agent", "--server", server.url,
                        "--data-dir", str(server.data_dir / f"agent-{i}"), "--name", f"serve-{suffix}-{i}",
                        "--simulate", f"{s.gpus // s.nodes}x{DEVICE}"]  # fmt: skip
                with open(server.data_dir / f"agent-{i}.log", "ab") as log:
                    agents.append(
                        subprocess.Popen(
                            argv,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            env=env,
                            start_new_session=True,
                        )  # fmt: skip
                    )
            deadline = time.monotonic() + 60
            while sum(n.get("state") == "ready" for n in admin.list_nodes()) < s.nodes:
                dead = [a for a in agents if a.poll() is not None]
                if dead or time.monotonic() > deadline:
                    logs = [server.data_dir / f"agent-{i}.log" for i in range(s.nodes)]
                    last = [ln for p in logs for ln in p.read_text(errors="replace").splitlines()[-1:]]
                    raise RuntimeError(f"the bench's {s.nodes} agents did not all join: {' | '.join(last)}")
                time.sleep(0.3)
            yield server, admin
        finally:
            _empty(admin)  # agents leave their jobs running when they stop: end the jobs first
            for a in agents:
                a.terminate()
            for a in agents:
                try:
                    a.wait(30)
                except subprocess.TimeoutExpired:
                    a.kill()
                    a.wait()


def _empty(admin: PoolClient, timeout_s: float = 30.0) -> None:
    """Best effort, on the way out (also after a failure): delete the services, cancel the rest."""
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(PoolError, ServerUnreachable):
        for svc in admin.services():
            with contextlib.suppress(PoolError):
                admin.delete_service(str(svc["name"]), tenant=str(svc["tenant"]))
        while time.monotonic() < deadline:
            live = [a for a in admin.list_allocations(limit=10_000) if a["state"] not in ENDED_STATES]
            if not live:
                return
            for a in live:
                with contextlib.suppress(PoolError):
                    admin.cancel_allocation(a["id"])
            time.sleep(0.5)


def _tenant_token(admin: PoolClient, tenant: str) -> str:
    admin.create_tenant(tenant)
    user = f"{tenant}-bench"
    admin.create_user(user, tenant, "member")
    return str(admin.create_token(user=user, name="bench serve")["token"])


def _engine_blob(client: PoolClient) -> str:
    """The stdlib engine, packed like `cpool run` packs a directory, as the replicas' code."""
    src = Path(__file__).resolve().parent.parent / "serving" / "simengine.py"
    with tempfile.TemporaryDirectory(prefix="cpool-bench-engine-") as d:
        shutil.copy(src, Path(d) / "simengine.py")
        return client.put_blob(pack(Path(d)))


# -- one arm -----------------------------------------------------------------------------------


def _spec(s: ServeBenchSettings, arm: _Arm, code: str) -> dict[str, Any]:
    command = ["python3", "simengine.py", "--slots", str(s.slots), "--ms-per-token", f"{s.ms_per_token:g}"]
    return {
        "request": {"name": arm.name, "gpus": 1, "command": command, "code": code, "priority": 10},
        "port_env": "PORT",
        "min_replicas": arm.min_replicas,
        "max_replicas": arm.max_replicas,
        "target_inflight": arm.target_inflight,
        # beyond its slots a request waits in the gateway's queue, where the autoscaler sees it
        "max_inflight": s.slots,
        "health_path": "/health",
        "startup_grace_s": 60,
        "scale_down_delay_s": arm.scale_down_delay_s,
        "drain_s": 10,
        "queue_timeout_s": 60,
    }


def _wait_ready(client: PoolClient, name: str, want: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        svc = client.service(name)
        if int(svc["ready"]) >= want:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"service {name}: {svc['ready']} of {want} replicas ready after {READY_TIMEOUT_S:.0f} s "
                f"({svc.get('reason') or 'no reason given'})"
            )
        time.sleep(0.5)


async def _keep_batch_backlog(api: AioApi, s: ServeBenchSettings, stop: asyncio.Event) -> None:
    """Hold `gpus` batch jobs pending, so the scheduler always has work for a free device."""
    job_s = s.batch_job_hours * s.trace.hour_s
    body = {"name": "batch", "gpus": 1, "restartable": True, "command": [SLEEP, f"{job_s:g}"]}
    while not stop.is_set():
        with contextlib.suppress(PoolError, ServerUnreachable):
            pending = await api.call("GET", "/allocations", params={"state": "pending", "limit": "1000"})
            for _ in range(s.gpus - len(pending["items"])):
                await api.call("POST", "/allocations", body, {"Idempotency-Key": uuid.uuid4().hex})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.5)


async def _watch(api: AioApi, name: str, stop: asyncio.Event, ready: list[tuple[float, int]]) -> None:
    """The service's ready replicas, once a second (for the report's mean, peak and day)."""
    t0 = time.monotonic()
    while not stop.is_set():
        with contextlib.suppress(PoolError, ServerUnreachable):
            svc = await api.call("GET", f"/services/{name}")
            ready.append((time.monotonic() - t0, int(svc["ready"])))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)


async def _replay(url: str, token: str, model: str, arrivals: list[float], s: ServeBenchSettings) -> _Replay:
    """Send each request at its time (open loop) and time it from send to the last byte."""
    out = _Replay()
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=120)
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(
        headers=headers, timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        t0 = loop.time()

        async def one(i: int, at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - loop.time()))
            body = {"model": model, "prompt": f"{PROMPT} ({i})", "max_tokens": s.max_tokens}
            start = time.perf_counter()
            try:
                async with http.post(f"{url}/v1/completions", json=body) as r:
                    text = await r.text()
                    if r.status != 200:
                        out.fail(f"HTTP {r.status}: {text[:200]}")
                        return
            except (aiohttp.ClientError, TimeoutError) as e:
                out.fail(f"{type(e).__name__}: {e}")
                return
            out.latency_ms.append((time.perf_counter() - start) * 1000)

        await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
        await asyncio.sleep(
            max(0.0, t0 + s.day_s - loop.time())
        )  # the day lasts its length, quiet end or not
    return out


async def _day(
    url: str, tokens: dict[str, str], arm: _Arm, arrivals: list[float], s: ServeBenchSettings
) -> tuple[_Replay, list[tuple[float, int]], datetime, datetime]:
    stop = asyncio.Event()
    ready: list[tuple[float, int]] = []
    async with AioApi(url, tokens[BATCH], 8, 30) as batch_api, AioApi(url, tokens[INFERENCE], 4, 30) as inf:
        keeper = asyncio.create_task(_keep_batch_backlog(batch_api, s, stop))
        await asyncio.sleep(s.prefill_s)
        watcher = asyncio.create_task(_watch(inf, arm.name, stop, ready))
        start = datetime.now(UTC)
        replay = await _replay(url, tokens[INFERENCE], arm.name, arrivals, s)
        end = datetime.now(UTC)
        stop.set()
        await asyncio.gather(keeper, watcher)
    return replay, ready, start, end


def _ts(value: object) -> datetime | None:
    return datetime.fromisoformat(value) if isinstance(value, str) and value else None


def _held_hours(alloc: dict[str, Any], start: datetime, end: datetime, hour_s: float) -> float:
    """Device share × bound time within [start, end], in trace hours."""
    bound = _ts(alloc.get("bound_at"))
    if bound is None:
        return 0.0
    until = _ts(alloc.get("ended_at")) or end
    seconds = (min(until, end) - max(bound, start)).total_seconds()
    req = alloc["request"]
    return max(0.0, seconds) * int(req["gpus"]) * int(req["gpu_milli"]) / 1000 / hour_s


def _settle(admin: PoolClient, name: str, tokens_client: PoolClient) -> None:
    """Delete the service and cancel the batch work, then wait until nothing of either holds a device."""
    with contextlib.suppress(PoolError):
        tokens_client.delete_service(name)
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        live = [a for a in admin.list_allocations(limit=10_000) if a["state"] not in ENDED_STATES]
        if not live:
            return
        for a in live:
            if a["tenant"] == BATCH:
                with contextlib.suppress(PoolError):
                    admin.cancel_allocation(a["id"])
        time.sleep(0.5)
    raise RuntimeError(f"the pool did not empty within {SETTLE_TIMEOUT_S:.0f} s after the {name} arm")


def _by_hour(samples: list[tuple[float, int]], hour_s: float) -> list[float | None]:
    """The mean of the samples taken in each trace hour (None for an hour without one)."""
    hours: list[list[int]] = [[] for _ in range(24)]
    for t, n in samples:
        hours[min(23, int(t / hour_s))].append(n)
    return [round(sum(h) / len(h), 1) if h else None for h in hours]


def _run_arm(
    server: LocalProcess,
    admin: PoolClient,
    tokens: dict[str, str],
    code: str,
    arm: _Arm,
    s: ServeBenchSettings,
    arrivals: list[float],
    say: Say,
) -> dict[str, Any]:
    hour_s = s.trace.hour_s
    with PoolClient(server.url, tokens[INFERENCE]) as inf:
        inf.put_service(arm.name, _spec(s, arm, code))
        say(f"{arm.name}: waiting for {arm.min_replicas} replica(s) to answer their health check …")
        _wait_ready(inf, arm.name, max(1, arm.min_replicas))
        say(f"{arm.name}: replaying {len(arrivals)} requests over {s.day_s:g} s …")
        replay, ready, start, end = asyncio.run(_day(server.url, tokens, arm, arrivals, s))
        allocs = admin.list_allocations(limit=10_000)
        _settle(admin, arm.name, inf)
    replica_name = f"svc-{arm.name}"[:63]
    replicas = [a for a in allocs if a["tenant"] == INFERENCE and a["name"] == replica_name]
    done = [
        a
        for a in allocs
        if a["tenant"] == BATCH
        and a["state"] == "released"
        and a.get("exit_code") == 0
        and (ended := _ts(a.get("ended_at"))) is not None
        and start <= ended <= end
    ]
    batch = [a for a in allocs if a["tenant"] == BATCH]
    day = max(1e-9, (end - start).total_seconds())
    return {
        "replicas": f"{arm.min_replicas}-{arm.max_replicas}"
        if arm.min_replicas != arm.max_replicas
        else str(arm.max_replicas),
        "target_inflight": arm.target_inflight,
        "requests": len(arrivals),
        "p50_ms": percentile(replay.latency_ms, 50),
        "p99_ms": percentile(replay.latency_ms, 99),
        "max_ms": round(max(replay.latency_ms), 3) if replay.latency_ms else None,
        "failed": replay.failed,
        "gpu_hours": round(sum(_held_hours(a, start, end, hour_s) for a in replicas), 2),
        "batch_gpu_hours": round(sum(int(a["request"]["gpus"]) for a in done) * s.batch_job_hours, 2),
        "batch_jobs_done": len(done),
        "batch_requeues": sum(max(0, int(a.get("attempt") or 1) - 1) for a in batch),
        "replica_starts": len(replicas),
        "ready_replicas_mean": round(sum(n for _, n in ready) / len(ready), 2) if ready else None,
        "ready_replicas_max": max(n for _, n in ready) if ready else None,
        "ready_replicas_by_hour": _by_hour(ready, hour_s),
        "day_s": round(day, 2),
        "error_samples": replay.samples,
    }


def run_serve_bench(s: ServeBenchSettings, say: Say = lambda _: None) -> dict[str, Any]:
    """Both arms on the same trace; returns what `cpool bench serve --json` prints."""
    trace = s.trace
    arrivals = trace.arrivals()
    peak = s.peak_replicas
    arms = [
        _Arm("chat-static", peak, peak, s.slots, 0),
        _Arm("chat-pooled", min(s.min_replicas, peak), peak, s.target_inflight, s.scale_down_delay_s),
    ]
    out: dict[str, Any] = {}
    with _pool(s, say) as (server, admin):
        tokens = {t: _tenant_token(admin, t) for t in (INFERENCE, BATCH)}
        admin.set_quota(INFERENCE, {"gpu_milli": {"guaranteed": peak * 1000, "limit": s.gpus * 1000}})
        with PoolClient(server.url, tokens[INFERENCE]) as inf:
            code = _engine_blob(inf)  # a replica's code must be its tenant's blob
        for arm, key in zip(arms, ("static", "pooled"), strict=True):
            out[key] = _run_arm(server, admin, tokens, code, arm, s, arrivals, say)
    st, po = out["static"], out["pooled"]
    out["comparison"] = {
        "p99_ratio": round(po["p99_ms"] / st["p99_ms"], 3) if po["p99_ms"] and st["p99_ms"] else None,
        "gpu_hours_saved_pct": round(100 * (1 - po["gpu_hours"] / st["gpu_hours"]), 1)
        if st["gpu_hours"]
        else None,
        "batch_gpu_hours_gained": round(po["batch_gpu_hours"] - st["batch_gpu_hours"], 2),
    }
    out["trace"] = {**trace.describe(), "requests": len(arrivals), "per_hour": trace.per_hour(arrivals)}
    out["machine"] = {
        "cpus": os.cpu_count(),
        "nodes": s.nodes,
        "gpus": s.gpus,
        "devices": f"simulated {DEVICE}",
        "engine": {
            "kind": "simengine",
            "slots": s.slots,
            "ms_per_token": s.ms_per_token,
            "max_tokens": s.max_tokens,
            "service_s": round(s.service_s, 3),
        },
        "peak_replicas": peak,
        "batch_job_hours": s.batch_job_hours,
    }
    return out
