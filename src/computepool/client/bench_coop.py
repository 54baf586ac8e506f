"""`cpool bench coop`: cooperative inference end to end, on a pool of its own.

The bench writes the tiny Llama model (serving/tinymodel.py) under a fresh /var/cache root (jobs run
as their tenant's Unix user with a private /tmp and /var/tmp: the model must be world-readable elsewhere),
starts a `cpool server` and two root agents on loopback with LAN discovery (unicast only: mDNS on
a shared machine would also hear every other pool's agents) and one impostor — a discovery runtime
whose key comes from another secret — then:

1. waits until both agents report each other as verified peers and the impostor as rejected;
2. serves the model cooperatively three times, one service at a time so they do not share the CPUs:
   forced onto the fastest single device (`force_split` 1), forced over two nodes (2), and placed
   by the pool (no forcing; its plan is read back from `GET /services/{name}/plan`);
3. times greedy completions of one prompt through the gateway for each and compares the texts.

Everything it started is stopped on the way out, after an error or a Ctrl-C too: the services,
their allocations, the jobs' processes, the agents, the impostor, the server, the tenant's Unix
user and the root directory.
"""

from __future__ import annotations

import contextlib
import os
import platform
import secrets
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from computepool.client.bench_coop_pool import (
    BenchError,
    BenchPool,
    Say,
    bench_pool,
    peer_report,
    settle,
    wait_for,
)
from computepool.client.errors import PoolError, ServerUnreachable
from computepool.client.http import PoolClient

ENGINE_PYTHONS = ("/opt/computepool/llama-venv/bin/python", "/opt/computepool-test/llama-venv/bin/python")
PROMPT = "A pool of small machines"
MODEL_SEED = 7
CTX = 256
READY_TIMEOUT_S = 420.0  # probes of every device on a busy two-core VM come first
SETTLE_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 300.0
PLAN_SETTLE_S = 120.0


def default_engine_python() -> str:
    """$CPOOL_LLAMA_PYTHON, else the first llama venv of scripts/llama-venv.sh that exists."""
    env = os.environ.get("CPOOL_LLAMA_PYTHON")
    if env:
        return env
    for p in ENGINE_PYTHONS:
        if Path(p).exists():
            return p
    return ENGINE_PYTHONS[0]


def check_engine_python(python: str) -> None:
    if not Path(python).is_file() or not os.access(python, os.X_OK):
        raise BenchError(
            f"no llama.cpp Python at {python}: build one with scripts/llama-venv.sh (llama-cpp-python "
            "with GGML_RPC=ON), or name it with --engine-python / CPOOL_LLAMA_PYTHON"
        )


@dataclass(frozen=True)
class CoopBenchSettings:
    engine_python: str
    tokens: int = 32  # completion tokens per timed request
    runs: int = 3  # timed requests per service (after one warm-up)
    prompt: str = PROMPT

    def __post_init__(self) -> None:
        if not 1 <= self.tokens <= CTX - 64:
            raise ValueError(f"tokens: between 1 and {CTX - 64}, got {self.tokens}")
        if not 1 <= self.runs <= 100:
            raise ValueError(f"runs: between 1 and 100, got {self.runs}")


# -- services ----------------------------------------------------------------------------------


def _spec(s: CoopBenchSettings, model: Path, force_split: int | None) -> dict[str, Any]:
    coop: dict[str, Any] = {
        "model": str(model), "model_key": f"bench-tiny-{MODEL_SEED}", "engine_python": s.engine_python,
        "ctx": CTX, "max_nodes": 2,
    }  # fmt: skip
    if force_split is not None:
        coop["force_split"] = force_split
    return {
        "request": {"cpu_milli": 1000},
        "port_env": "PORT",
        "min_replicas": 1,
        "max_replicas": 1,
        "health_path": "/health",
        "startup_grace_s": 300,
        "drain_s": 0,
        "cooperative": coop,
    }


def _plan(client: PoolClient, name: str) -> dict[str, Any]:
    return client.service_plan(name)


def _settled_plan(client: PoolClient, name: str) -> dict[str, Any]:
    """The plan once the controller has timed the running replica itself: an unforced split it finds
    slower than the best single device is re-planned then, and the bench must time what stays. As
    it stands after PLAN_SETTLE_S otherwise."""
    deadline = time.monotonic() + PLAN_SETTLE_S
    while True:
        plan = _plan(client, name)
        if plan.get("status") == "failed":
            raise BenchError(f"service {name}: its plan failed: {plan.get('reason')}")
        settled = plan.get("status") == "running" and plan.get("measured_tokens_per_s") is not None
        if (settled and int(client.service(name)["ready"]) >= 1) or time.monotonic() > deadline:
            return plan
        time.sleep(0.5)


def _wait_serving(pool: BenchPool, client: PoolClient, name: str) -> None:
    def ready() -> bool:
        svc = client.service(name)
        if int(svc["ready"]) >= 1:
            return True
        with contextlib.suppress(PoolError):
            plan = _plan(client, name)
            if plan.get("status") == "failed":
                raise BenchError(f"service {name}: its plan failed: {plan.get('reason')}")
        return False

    try:
        wait_for(f"service {name} to answer", ready, READY_TIMEOUT_S, [pool.server, *pool.agents])
    except BenchError as e:
        why = ""
        with contextlib.suppress(PoolError, ServerUnreachable, httpx.HTTPError):
            plan = _plan(client, name)
            why = f" (plan {plan.get('status')}: {plan.get('reason')})"
        raise BenchError(f"{e}{why}") from None


def _complete(http: httpx.Client, name: str, s: CoopBenchSettings) -> tuple[str, int, float]:
    body = {"model": name, "prompt": s.prompt, "max_tokens": s.tokens, "temperature": 0}
    t0 = time.perf_counter()
    r = http.post("/v1/completions", json=body)
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        raise BenchError(f"service {name}: completion answered HTTP {r.status_code}: {r.text[:200]}")
    got = r.json()
    return str(got["choices"][0]["text"]), int(got["usage"]["completion_tokens"]), elapsed


def _shards(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {k: sh.get(k) for k in ("node", "device", "role", "first_layer", "layers", "endpoint")}
        for sh in plan.get("shards") or []
    ]


def _measure(
    pool: BenchPool, admin: PoolClient, client: PoolClient, token: str, name: str, spec: dict[str, Any],
    s: CoopBenchSettings, say: Say,
) -> dict[str, Any]:  # fmt: skip
    """Put the service, wait for it, time `runs` greedy completions, read its plan, delete it."""
    say(f"{name}: planning and starting (measuring every device first) …")
    t0 = time.monotonic()
    client.put_service(name, spec)
    try:
        _wait_serving(pool, client, name)
        ready_s = time.monotonic() - t0
        _settled_plan(client, name)
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=pool.url, headers=headers, timeout=REQUEST_TIMEOUT_S) as http:
            text, _, _ = _complete(http, name, s)  # warm-up (and the text to compare)
            say(f"{name}: timing {s.runs} completions of {s.tokens} tokens …")
            rates = []
            for _ in range(s.runs):
                again, n, elapsed = _complete(http, name, s)
                if again != text:
                    raise BenchError(f"service {name}: greedy decoding gave two texts for one prompt")
                rates.append(n / elapsed)
        plan = _plan(client, name)
    finally:
        _drop(admin, client, name, pool.tenant)
    return {
        "text": text,
        "tokens_per_s": round(statistics.median(rates), 2),
        "runs_tokens_per_s": [round(r, 2) for r in rates],
        "ready_after_s": round(ready_s, 1),
        "shards": _shards(plan),
        "predicted_tokens_per_s": plan.get("predicted_tokens_per_s"),
        "pool_measured_tokens_per_s": plan.get("measured_tokens_per_s"),
        "plan_status": plan.get("status"),
        "reason": plan.get("reason"),
        "plan": plan,
    }


def _drop(admin: PoolClient, client: PoolClient, name: str, tenant: str) -> None:
    """Delete the service and wait until none of the tenant's allocations (replica, RPC servers,
    probes) holds anything: the next service must have the CPUs to itself."""
    with contextlib.suppress(PoolError, ServerUnreachable):
        client.delete_service(name)
    settle(admin, tenant, SETTLE_TIMEOUT_S)


def _machine(s: CoopBenchSettings) -> dict[str, Any]:
    cpu = platform.processor() or "cpu"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    version = subprocess.run(
        [s.engine_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
        capture_output=True, text=True, timeout=60, check=False,
    ).stdout.strip()  # fmt: skip
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "engine_python": s.engine_python,
        "llama_cpp": version or None,
    }


def _auth_cost() -> dict[str, Any] | None:
    try:
        from computepool.discovery import bench
    except ImportError:
        return None
    return dict(bench.auth_cost())


def run_coop_bench(
    s: CoopBenchSettings, say: Say = lambda _: None, forget_tenant: Callable[[str], object] = lambda _: None
) -> dict[str, Any]:
    """The whole bench; returns what `cpool bench coop --json` prints."""
    from computepool.serving.tinymodel import write_tiny_llama

    check_engine_python(s.engine_python)
    if os.geteuid() != 0:
        raise BenchError("the bench's agents run jobs as tenant users: run it as root")
    with bench_pool(say, forget_tenant) as (pool, admin):
        models = pool.root / "models"
        models.mkdir(mode=0o755)
        model = write_tiny_llama(models / "tiny.gguf", seed=MODEL_SEED)
        model.chmod(0o644)
        peers = peer_report(pool, admin, say)

        pool.tenant = f"cb{secrets.token_hex(3)}"
        admin.create_tenant(pool.tenant)
        admin.create_user(f"{pool.tenant}-bench", pool.tenant, "member")
        token = str(admin.create_token(user=f"{pool.tenant}-bench", name="bench coop")["token"])
        with PoolClient(pool.url, token, timeout=60) as client:
            arms = {}
            for arm, force in (("single", 1), ("split", 2), ("chosen", None)):
                arms[arm] = _measure(
                    pool, admin, client, token, f"coop-{arm}", _spec(s, model, force), s, say
                )
    single, split, chosen = arms["single"], arms["split"], arms["chosen"]
    return {
        "peers_found": peers["peers_found"],
        "peers_rejected": peers["peers_rejected"],
        "split_equals_single": single["text"] == split["text"],
        "single_tokens_per_s": single["tokens_per_s"],
        "split_tokens_per_s": split["tokens_per_s"],
        "chosen": chosen["shards"],
        "chosen_tokens_per_s": chosen["tokens_per_s"],
        "chosen_equals_single": chosen["text"] == single["text"],
        "chosen_reason": chosen["reason"],
        "single": {k: v for k, v in single.items() if k not in ("text", "plan")},
        "split": {k: v for k, v in split.items() if k not in ("text", "plan")},
        "plan": chosen["plan"],
        "peers": {k: peers[k] for k in ("found", "rejected", "links")},
        "discovery": {"seen_after_s": peers["seen_after_s"], "auth_cost": _auth_cost()},
        "prompt": s.prompt,
        "tokens": s.tokens,
        "runs": s.runs,
        "text": single["text"],
        "model": {
            "kind": "tiny llama (2 layers, hidden 64, byte vocabulary)",
            "seed": MODEL_SEED,
            "ctx": CTX,
        },
        "machine": _machine(s),
    }
