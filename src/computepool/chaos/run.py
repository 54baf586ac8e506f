"""One chaos run: a workload through the API while faults are injected one at a time, then the oracle.

The workload (two tenants): short jobs, long restartable and non-restartable ones, gangs over two
nodes, exclusive jobs, code uploads, and cancels, about two operations a second. The faults, in a
random order drawn from the seed, each kind at least once when the run is long enough (six
minutes is):

- `leader_kill` / `standby_kill`: kill -9 of that server replica; restarted once the pool binds
  again (the failover time: kill → the first bind of a job submitted after it);
- `leader_freeze`: SIGSTOP of the leader for 5-20 s, then SIGCONT;
- `agent_kill`: kill -9 of an agent, restarted after 2-10 s (its jobs run on);
- `agent_freeze`: SIGSTOP of an agent alone for 5-30 s;
- `freeze_node`: the agent, its supervisors and jobs frozen for 10-40 s (past the lost time);
- `database_stop`: PostgreSQL stopped (immediate) for 5-120 s (scaled down on short runs);
- `disk_full`: the replicas' blob directory (a 64 MiB tmpfs of the run's) filled for 5-20 s;
  uploads meanwhile must be refused with 507, never 500.

Then everything is healed, the pool is given time to drain, and the oracle (oracle.py) judges.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from computepool.chaos.cluster import ApiRefused, Cluster, ClusterError, cpool_argv
from computepool.chaos.oracle import (
    JOB,
    CapacitySampler,
    Collector,
    ledger_violations,
    time_order_violations,
)

FAULTS = (
    "leader_kill",
    "leader_freeze",
    "standby_kill",
    "agent_kill",
    "agent_freeze",
    "freeze_node",
    "database_stop",
    "disk_full",
)
ENDED = ("released", "preempted", "failed", "cancelled")


@dataclass
class Submitted:
    label: str
    id: int
    tenant: str
    kind: str
    restartable: bool
    cancelled: bool = False


class Run:
    """The state of one run: the pool, the oracle's parts, what was acknowledged, what was done."""

    def __init__(
        self, root: Path, seed: int, minutes: float, kinds: tuple[str, ...], say: Callable[[str], None]
    ):
        self.rng = random.Random(seed)
        self.minutes, self.kinds, self.say = minutes, kinds, say
        self.scale = min(1.0, max(0.25, minutes / 6))  # a short run's faults and long jobs shrink
        self.cluster = Cluster(root)
        self.collector = Collector()
        self.sampler: CapacitySampler | None = None
        self.tokens: dict[str, str] = {}
        self.submitted: list[Submitted] = []
        self.operations = 0
        self.ledger_checked = 0  # allocations whose ledger rows the verdict compared
        self.errors: list[str] = []  # answers that break the contract (5xx other than 503, 507 aside)
        self.faults: Counter[str] = Counter()
        self.failover: list[float] = []
        self.silenced: set[str] = set()  # nodes a fault silenced: "node lost" is true of them
        self.log: list[str] = []  # what each fault did, in order, seconds since the run began
        self.t0 = time.monotonic()
        self._lock = threading.Lock()

    # ---- set up ------------------------------------------------------------------------------
    def setup(self) -> None:
        c = self.cluster
        c.start()
        for t in ("chaos-a", "chaos-b"):
            c.call("POST", "/api/v1/tenants", json={"name": t})
            c.call("POST", "/api/v1/users", json={"name": f"m-{t}", "tenant": t, "role": "member"})
            self.tokens[t] = c.call("POST", "/api/v1/tokens", json={"user": f"m-{t}"})["token"]
        self.sampler = CapacitySampler(c.pg.dsn)
        self.sampler.start()

    # ---- the workload ------------------------------------------------------------------------
    def submit(self, kind: str, tenant: str | None = None) -> Submitted | None:
        tenant = tenant or self.rng.choice(sorted(self.tokens))
        label = f"j{uuid.uuid4().hex[:10]}"
        restartable = kind in ("long-restartable", "gang")
        seconds = {"short": self.rng.uniform(0.5, 4), "probe": 0.5, "exclusive": self.rng.uniform(2, 10)}.get(
            kind,
            self.rng.uniform(15, 60) * self.scale,  # long work: shorter on a short run
        )
        body: dict[str, Any] = {
            "command": ["python3", "-c", JOB, label, f"{seconds:.1f}", str(self.collector.port)],
            "cpu_milli": 100,
            "memory_mib": 128,
            "restartable": restartable,
        }
        if kind == "gang":
            body |= {"gang_nodes": 2, "gpus": 1, "gpu_milli": 500}
        elif kind == "exclusive":
            body |= {"gpus": 1, "exclusive": True}
        elif kind != "probe":
            body |= {"gpus": 1, "gpu_milli": self.rng.choice([250, 500])}
        try:
            got = self.cluster.call("POST", "/api/v1/allocations", token=self.tokens[tenant], json=body)
        except ApiRefused as e:
            if e.status >= 500 and e.status != 507:
                self.errors.append(f"submit answered {e.status}: {e.body[:200]}")
            return None
        except ClusterError:
            return None  # no replica answered: not acknowledged, nothing to hold the pool to
        s = Submitted(label, int(got["id"]), tenant, kind, restartable)
        with self._lock:
            self.submitted.append(s)
        return s

    def cancel_one(self) -> None:
        live = [s for s in self.submitted if not s.cancelled and s.kind != "probe"]
        if not live:
            return
        s = self.rng.choice(live[-20:])
        with contextlib.suppress(ApiRefused, ClusterError):
            self.cluster.call("POST", f"/api/v1/allocations/{s.id}/cancel", token=self.tokens[s.tenant])
            s.cancelled = True

    def upload(self) -> None:
        data = os.urandom(self.rng.randint(1024, 256 * 1024))
        sha = hashlib.sha256(data).hexdigest()
        tenant = self.rng.choice(sorted(self.tokens))
        try:
            self.cluster.call("PUT", f"/api/v1/blobs/{sha}", token=self.tokens[tenant], content=data)
        except ApiRefused as e:
            if e.status >= 500 and e.status != 507:
                self.errors.append(f"upload answered {e.status}: {e.body[:200]}")
        except ClusterError:
            pass

    def operate(self) -> None:
        self.operations += 1
        r = self.rng.random()
        if r < 0.40:
            self.submit("short")
        elif r < 0.52:
            self.submit("long-restartable")
        elif r < 0.62:
            self.submit("long")
        elif r < 0.70:
            self.submit("gang")
        elif r < 0.78:
            self.submit("exclusive")
        elif r < 0.90:
            self.cancel_one()
        else:
            self.upload()

    # ---- faults ------------------------------------------------------------------------------
    def plan(self) -> list[str]:
        """The faults of the run, in order: every kind once (shuffled), then more at random, one
        every ~40 s in all (a run too short for them all ends with those it got to)."""
        slots = max(1, int(self.minutes * 60 // 40))  # one fault every ~40 s
        kinds = list(self.kinds)
        self.rng.shuffle(kinds)
        while len(kinds) < slots:
            kinds.append(self.rng.choice(self.kinds))
        return kinds

    def inject(self, kind: str, scale: float) -> None:
        c = self.cluster
        self.faults[kind] += 1
        began = time.monotonic()

        def note(what: str) -> None:
            line = f"{began - self.t0:6.1f}s {kind}: {what} ({time.monotonic() - began:.1f} s)"
            self.log.append(line)
            self.say(line)

        if kind in ("leader_kill", "standby_kill"):
            leader = c.leader()
            names = [n for n in c.parts if n.startswith("server-")]
            target = leader if kind == "leader_kill" else next((n for n in names if n != leader), None)
            if target is None:
                return
            part = c.parts[target]
            t0 = time.monotonic()
            part.kill()
            took = self.time_to_bind(t0) if kind == "leader_kill" else None
            if took is not None:
                self.failover.append(took)
            part.start(c.env)
            note(f"{target} killed" + (f", next bind after {took:.2f} s" if took is not None else ""))
        elif kind == "leader_freeze":
            target = c.leader()
            if target is None:
                return
            part = c.parts[target]
            part.signal(signal.SIGSTOP)
            time.sleep(self.rng.uniform(5, 20) * scale)
            part.signal(signal.SIGCONT)
            note(f"{target} frozen")
        elif kind == "agent_kill":
            part = self.rng.choice(c.agents_())
            self.silenced.add(part.name)
            part.kill()
            time.sleep(self.rng.uniform(2, 10))
            part.start(c.env)
            note(f"{part.name} killed, restarted")
        elif kind == "agent_freeze":
            part = self.rng.choice(c.agents_())
            self.silenced.add(part.name)
            part.signal(signal.SIGSTOP)
            time.sleep(self.rng.uniform(5, 30) * scale)
            part.signal(signal.SIGCONT)
            note(f"{part.name} frozen")
        elif kind == "freeze_node":
            part = self.rng.choice(c.agents_())
            self.silenced.add(part.name)
            c.freeze_node(part)
            time.sleep(max(c.lost_s * 2, self.rng.uniform(10, 40) * scale))  # past lost: work moves
            c.thaw_node(part)
            note(f"{part.name} with its jobs frozen")
        elif kind == "database_stop":
            c.pg.stop("immediate")
            time.sleep(self.rng.uniform(5, 120) * scale)
            c.pg.start()
            note("PostgreSQL stopped")
        elif kind == "disk_full":
            if c.blob_mount is None:
                self.faults[kind] -= 1  # no tmpfs of our own here: nothing was injected
                return
            filler = c.blob_mount / f"filler-{uuid.uuid4().hex[:6]}"
            subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True, check=False)
            for _ in range(5):
                self.upload()
            time.sleep(self.rng.uniform(5, 20) * scale)
            filler.unlink(missing_ok=True)
            note("blob dir full")

    def time_to_bind(self, t0: float, timeout: float = 60) -> float | None:
        """Seconds from `t0` (a leader's death) to the first bind of a job submitted after it."""
        probe: Submitted | None = None
        while time.monotonic() - t0 < timeout:
            if probe is None:
                probe = self.submit("probe", "chaos-a")
            else:
                with contextlib.suppress(ApiRefused, ClusterError):
                    got = self.cluster.call("GET", f"/api/v1/allocations/{probe.id}", timeout=2)
                    if got["state"] != "pending":
                        return time.monotonic() - t0
            time.sleep(0.05)
        return None

    def heal(self) -> None:
        c = self.cluster
        for part in c.parts.values():
            if part.frozen and part.cgroup is not None:
                c.thaw_node(part)
            part.signal(signal.SIGCONT)
            if not part.alive:
                part.start(c.env)
        if not c._ready(c.urls[0]) and not c._ready(c.urls[-1]):
            with contextlib.suppress(Exception):
                c.pg.start()

    # ---- the verdict -------------------------------------------------------------------------
    def drain(self, timeout: float) -> dict[int, dict[str, Any]]:
        """Every acknowledged allocation, read back once they all ended (or `timeout` passed)."""
        deadline = time.monotonic() + timeout
        final: dict[int, dict[str, Any]] = {}
        while True:
            for s in self.submitted:
                if s.id in final and final[s.id]["state"] in ENDED:
                    continue
                with contextlib.suppress(ApiRefused, ClusterError):
                    final[s.id] = self.cluster.call("GET", f"/api/v1/allocations/{s.id}", timeout=5)
            if all(final.get(s.id, {}).get("state") in ENDED for s in self.submitted):
                return final
            if time.monotonic() > deadline:
                return final
            time.sleep(1)

    def verdict(self, final: dict[int, dict[str, Any]]) -> tuple[list[str], int]:
        v: list[str] = []
        lost = 0
        for s in self.submitted:
            got = final.get(s.id)
            if got is None:
                lost += 1
                v.append(f"allocation {s.id} ({s.kind}) was acknowledged and is gone")
                continue
            if got["state"] not in ENDED:
                v.append(f"allocation {s.id} ({s.kind}) never ended: {got['state']} ({got['reason']})")
            elif not got["reason"] and got["state"] != "released":
                v.append(f"allocation {s.id} ended {got['state']} without a reason")
            done = self.collector.finished(s.label)
            reason = str(got["reason"])
            was_silenced = any(f"node {n} lost" in reason for n in self.silenced)
            if done and got["state"] == "failed" and s.kind != "gang" and not was_silenced:
                v.append(
                    f"allocation {s.id} exited 0 (attempt {done[0][0]}) but was recorded failed: "
                    f"{got['reason']}"
                )
            if done and s.kind != "gang":
                ran = self.collector.attempts(s.label)
                later = {a for a in ran if a.isdigit() and int(a) > int(done[0][0])}
                if later:
                    v.append(
                        f"allocation {s.id} exited 0 in attempt {done[0][0]} and ran again "
                        f"(attempts {sorted(later)})"
                    )
        v += self.collector.duplicates()
        v += time_order_violations(final)
        try:
            wrong, self.ledger_checked = ledger_violations(
                self.cluster.pg.dsn, [s.id for s in self.submitted]
            )
            v += wrong
        except psycopg.Error as e:
            v.append(f"the usage ledger could not be read: {e}")
        if self.sampler is not None:
            v += self.sampler.violations
        v += self.errors
        audit = subprocess.run(
            cpool_argv("audit", "verify"), capture_output=True, text=True, timeout=120, env=self.cli_env()
        )
        if audit.returncode != 0:
            v.append(f"audit verify failed: {(audit.stdout + audit.stderr).strip()[-300:]}")
        return v, lost

    def cli_env(self) -> dict[str, str]:
        return {
            **self.cluster.env,
            "CPOOL_SERVER": self.cluster.urls[0],
            "CPOOL_TOKEN": self.cluster.admin_token,
        }


def run_chaos(
    minutes: float,
    seed: int,
    *,
    kinds: tuple[str, ...] = FAULTS,
    root: Path | None = None,
    drain_s: float = 240,
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Run the pool for `minutes` under faults drawn from `seed`; the figures and violations."""
    own = root is None
    root = root or Path(tempfile.mkdtemp(prefix="cpool-chaos-", dir="/var/tmp"))
    run = Run(root, seed, minutes, kinds, say)
    scale = run.scale
    try:
        run.setup()
        run.t0 = time.monotonic()
        say(f"pool up: {len(run.cluster.urls)} replicas, {run.cluster.agents} agents; {run.cluster.root}")
        plan = run.plan()
        started = time.monotonic()
        length = minutes * 60
        every = length / (len(plan) + 1)
        fault: threading.Thread | None = None
        injected = 0
        every_kind = len(kinds)  # each kind once, even if the run must go on past `minutes` for it

        def busy() -> bool:
            return fault is not None and fault.is_alive()

        while time.monotonic() - started < length or busy() or (plan and injected < every_kind):
            elapsed = time.monotonic() - started
            if elapsed < length:
                due = int(elapsed // every)
            else:  # past the end: only the kinds not injected yet, one after another
                due = injected + 1 if injected < every_kind else injected
            if plan and due > injected and not busy():
                fault = threading.Thread(target=run.inject, args=(plan.pop(0), scale), daemon=True)
                fault.start()
                injected += 1
            run.operate()  # the workload goes on as long as faults do
            time.sleep(run.rng.uniform(0.2, 0.8))
        run.heal()
        say("healed; draining")
        final = run.drain(drain_s)
        violations, lost = run.verdict(final)
        dup = [v for v in violations if v.startswith("two copies")]
        fo = run.failover
        return {
            "operations": run.operations,
            "acknowledged": len(run.submitted),
            "faults": dict(run.faults),
            "violations": violations,
            "failover_s": {
                "p50": round(statistics.median(fo), 2) if fo else None,
                "max": round(max(fo), 2) if fo else None,
            },
            "lost": lost,
            "duplicates": len(dup),
            "restarts": sum(max(0, int(f.get("attempt") or 1) - 1) for f in final.values()),
            "capacity_samples": run.sampler.samples if run.sampler else 0,
            "ledger_checked": run.ledger_checked,
            "fault_log": run.log,
            "seed": seed,
            "minutes": minutes,
        }
    finally:
        run.collector.close()
        if run.sampler is not None:
            run.sampler.close()
        run.cluster.close()
        if own:
            shutil.rmtree(root, ignore_errors=True)
