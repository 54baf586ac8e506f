"""`cpool bench api`: end-to-end allocate → bound → release cycles against a live server.

N asyncio clients share one aiohttp connection pool; each cycle submits a fractional allocation
(timing the POST), long-polls until the scheduler binds it, and releases it. When the pool has no
ready node, simulated nodes are joined through the ordinary join protocol (and kept alive with
heartbeats for the run), so the scheduler sees a real inventory without any agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from computepool.client.aio import AioApi
from computepool.client.errors import PoolError, ServerUnreachable
from computepool.client.http import ENDED_STATES, PENDING

DEVICES_PER_NODE = 8
DEVICE_MEMORY_MIB = 80 * 1024
MAX_CYCLES_PER_CLIENT = 1_000_000
MAX_ERROR_SAMPLES = 5


@dataclass(frozen=True)
class BenchSettings:
    server: str
    token: str
    clients: int = 50
    seconds: float = 30.0
    nodes: int = 20
    gpu_milli: int = 250
    bind_timeout_s: float = 30.0
    poll_max_s: float = 10.0  # one long-poll answers as soon as the allocation is bound
    keep_nodes: bool = False
    http_timeout_s: float = 30.0


@dataclass
class _Tally:
    submit_ms: list[float] = field(default_factory=list)
    cycle_ms: list[float] = field(default_factory=list)
    errors: int = 0
    samples: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.samples) < MAX_ERROR_SAMPLES:
            self.samples.append(what)


def is_loopback(server: str) -> bool:
    host = urlsplit(server).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Nearest-rank percentile; None for no data (JSON null), so an empty run is not a zero."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return round(ordered[rank - 1], 3)


@dataclass
class _SimNodes:
    names: list[str]
    credentials: list[str]
    interval_s: float


async def _ensure_nodes(api: AioApi, count: int) -> _SimNodes | None:
    """Join `count` simulated nodes of the bench's own, kept alive by it for the run, so that the
    figures do not hang on what else the pool holds (a node that stops beating mid-run turns
    suspect and takes no more work). A token that may not join nodes uses the pool's ready ones."""
    try:
        jt = await api.call("POST", "/join-tokens", {"expires_in_s": 3600, "single_use": False})
    except PoolError as e:
        if e.status not in (401, 403, 404):
            raise
        nodes = (await api.call("GET", "/nodes"))["items"]
        if any(n.get("state") == "ready" and not n.get("cordoned") for n in nodes):
            return None
        raise PoolError(
            e.status, f"the pool has no ready node and this token cannot join simulated ones: {e.message}"
        ) from None
    prefix = f"bench-{secrets.token_hex(3)}"

    async def join(i: int) -> tuple[str, str, float]:
        name = f"{prefix}-{i:03d}"
        devices = [
            {
                "index": d,
                "vendor": "nvidia",
                "model": "H100-80GB",
                "memory_mib": DEVICE_MEMORY_MIB,
                "uuid": f"GPU-{name}-{d}",
                "link_group": "nvl0",
            }
            for d in range(DEVICES_PER_NODE)
        ]
        body = {
            "join_token": jt["token"],
            "name": name,
            "cpu_milli": 128_000,
            "memory_mib": 1024 * 1024,
            "labels": {"bench": "api"},
            "devices": devices,
        }
        out = await api.call("POST", "/nodes/join", body)
        return name, str(out["credential"]), float(out.get("heartbeat_interval_s", 5.0))

    joined = await asyncio.gather(*(join(i) for i in range(count)))
    return _SimNodes([j[0] for j in joined], [j[1] for j in joined], min(j[2] for j in joined))


async def _heartbeats(api: AioApi, sim: _SimNodes, stop: asyncio.Event) -> None:
    """Keep the simulated nodes `ready` for the whole run, as an agent would."""
    while not stop.is_set():
        for name, cred in zip(sim.names, sim.credentials, strict=True):
            # a missed beat is not the bench's concern; the next one follows
            with contextlib.suppress(PoolError, ServerUnreachable):
                await api.call("POST", f"/nodes/{name}/heartbeat", {}, {"Authorization": f"Bearer {cred}"})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=sim.interval_s / 2)


async def _cycle(api: AioApi, s: BenchSettings, tally: _Tally) -> None:
    """Submit, wait for the binding, release; a failure at any step counts one error."""
    body = {"name": "bench", "gpus": 1, "gpu_milli": s.gpu_milli}
    t0 = time.perf_counter()
    try:
        alloc = await api.call("POST", "/allocations", body, {"Idempotency-Key": uuid.uuid4().hex})
    except (PoolError, ServerUnreachable) as e:
        tally.error(f"submit: {e}")
        return
    tally.submit_ms.append((time.perf_counter() - t0) * 1000)
    alloc_id = alloc["id"]
    deadline = time.monotonic() + s.bind_timeout_s
    try:
        while alloc.get("state") == PENDING and time.monotonic() < deadline:
            wait = round(min(s.poll_max_s, max(0.0, deadline - time.monotonic())), 3)
            alloc = await api.call(
                "GET", f"/allocations/{alloc_id}", params={"wait": str(wait), "state": PENDING}
            )
        state = alloc.get("state")
        if state == PENDING:
            tally.error(f"allocation {alloc_id} not bound within {s.bind_timeout_s:g} s")
            await api.call("POST", f"/allocations/{alloc_id}/cancel")
            return
        if state in ENDED_STATES:
            tally.error(f"allocation {alloc_id} ended {state}: {alloc.get('reason')}")
            return
        await api.call("POST", f"/allocations/{alloc_id}/release")
    except (PoolError, ServerUnreachable) as e:
        tally.error(f"allocation {alloc_id}: {e}")
        return
    tally.cycle_ms.append((time.perf_counter() - t0) * 1000)


async def _client(api: AioApi, s: BenchSettings, tally: _Tally, deadline: float) -> int:
    done = 0
    while time.monotonic() < deadline and done < MAX_CYCLES_PER_CLIENT:
        await _cycle(api, s, tally)
        done += 1
    return done


async def run_api_bench(s: BenchSettings) -> dict[str, Any]:
    """Run the benchmark; returns the figures `cpool bench api --json` prints."""
    async with AioApi(s.server, s.token, s.clients + 4, s.http_timeout_s) as api:
        sim = await _ensure_nodes(api, s.nodes)
        stop = asyncio.Event()
        beats = asyncio.create_task(_heartbeats(api, sim, stop)) if sim else None
        tally = _Tally()
        try:
            t0 = time.monotonic()
            deadline = t0 + s.seconds
            await asyncio.gather(*(_client(api, s, tally, deadline) for _ in range(s.clients)))
            elapsed = time.monotonic() - t0
        finally:
            stop.set()
            if beats is not None:
                await beats
            if sim and not s.keep_nodes:
                for name in sim.names:  # one left behind turns lost and can be deleted by hand
                    with contextlib.suppress(PoolError, ServerUnreachable):
                        await api.call("DELETE", f"/nodes/{name}")
    cycles = len(tally.cycle_ms)
    return {
        "ops_per_s": round(cycles / elapsed, 2) if elapsed > 0 else 0.0,
        "p50_ms": percentile(tally.submit_ms, 50),
        "p99_ms": percentile(tally.submit_ms, 99),
        "cycle_p50_ms": percentile(tally.cycle_ms, 50),
        "cycle_p99_ms": percentile(tally.cycle_ms, 99),
        "errors": tally.errors,
        "clients": s.clients,
        "seconds": s.seconds,
        "elapsed_s": round(elapsed, 3),
        "cycles": cycles,
        "submits": len(tally.submit_ms),
        "gpu_milli": s.gpu_milli,
        "nodes_joined": len(sim.names) if sim else 0,
        "error_samples": tally.samples,
    }
