"""Helpers of the gateway tests: real simulated engines, and replicas registered in the database.

A replica is what the service controller would make: an active allocation of the service with
replica_state "ready" on a node whose address is 127.0.0.1 and whose port a real engine
(serving/simengine.py, run by /usr/bin/python3) listens on. The node is cordoned so that the
scheduler places nothing there; the service's spec keeps the controller from resizing it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
from harness import free_port
from sqlalchemy import select, update

import computepool
from computepool.store.db import Database
from computepool.store.models import Allocation, AllocationNode, GatewayLoad, Node, Service, Tenant
from computepool.wire.services import ServiceSpec

SIMENGINE = Path(computepool.__file__).parent / "serving" / "simengine.py"
ENGINE_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
SRC = Path(computepool.__file__).parent.parent


def wait_until(check: Any, timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@contextmanager
def engine(model: str = "sim", slots: int = 4, ms_per_token: float = 1.0, seed: int = 0) -> Iterator[int]:
    """A simengine process on a free loopback port; yields the port."""
    port = free_port()
    cmd = [ENGINE_PYTHON, str(SIMENGINE), "--host", "127.0.0.1", "--port", str(port), "--model", model,
           "--slots", str(slots), "--ms-per-token", str(ms_per_token), "--seed", str(seed)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:

        def up() -> bool:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "engine exited"
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, 15, "the engine")
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Registry:
    """Services and ready replicas written straight into the pool's database."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.node = f"gw-{uuid.uuid4().hex[:8]}"
        now = datetime.now(UTC)
        with db.write() as s:
            s.add(Node(name=self.node, cpu_milli=1000, memory_mib=1024, labels={}, cordoned=True,
                       draining=False, taints={}, address="127.0.0.1", pythons=[], joined_at=now,
                       last_heartbeat_at=now))  # fmt: skip

    def service(self, tenant: str, name: str, owner: str = "alice", **spec: Any) -> int:
        fields: dict[str, Any] = {"min_replicas": 0, "max_replicas": 4, "scale_down_delay_s": 86_400,
                                  "idle_s": 86_400, **spec}  # fmt: skip
        full = ServiceSpec.model_validate({"request": {"command": ["engine"]}, **fields})
        now = datetime.now(UTC)
        with self.db.write() as s:
            tid = s.scalars(select(Tenant.id).where(Tenant.name == tenant)).one()
            row = Service(tenant_id=tid, owner=owner, name=name, spec=full.model_dump(mode="json"),
                          generation=1, desired=0, reason="", created_at=now, updated_at=now)  # fmt: skip
            s.add(row)
            s.flush()
            return int(row.id)

    def replica(self, service_id: int, port: int) -> int:
        now = datetime.now(UTC)
        with self.db.write() as s:
            svc = s.get(Service, service_id)
            assert svc is not None
            a = Allocation(
                name=f"svc-{svc.name}", tenant_id=svc.tenant_id, owner=svc.owner, request=svc.spec["request"],
                priority=0, command=["engine"], env={}, restartable=True, state="active", reason="replica",
                attempt=1, term=0, nodes=[self.node], slices=[], created_at=now, bound_at=now, started_at=now,
                service_id=service_id, service_generation=1, service_port=port, replica_state="ready",
                replica_since=now,
            )  # fmt: skip
            s.add(a)
            s.flush()
            s.add(AllocationNode(allocation_id=a.id, node=self.node))
            return int(a.id)

    def set_state(self, alloc_id: int, replica_state: str) -> None:
        with self.db.write() as s:
            s.execute(update(Allocation).where(Allocation.id == alloc_id).values(replica_state=replica_state))

    def loads_by_name(self, name: str) -> list[SimpleNamespace]:
        with self.db.read() as s:
            sid = s.scalars(select(Service.id).where(Service.name == name)).one()
        return self.loads(sid)

    def loads(self, service_id: int) -> list[SimpleNamespace]:
        """The gateways' load rows of the service, as plain values."""
        with self.db.read() as s:
            rows = s.scalars(select(GatewayLoad).where(GatewayLoad.service_id == service_id))
            cols = ("gateway", "service_id", "inflight", "queued", "replicas", "requests", "updated_at")
            return [SimpleNamespace(**{c: getattr(r, c) for c in cols}) for r in rows]


def cpool_cmd(*args: str) -> list[str]:
    exe = shutil.which("cpool", path=str(Path(sys.executable).parent))
    return [exe, *args] if exe else [sys.executable, "-m", "computepool.cli.main", *args]


@contextmanager
def gateway_process(db_url: str, log: Path) -> Iterator[str]:
    """`cpool gateway` on a free loopback port over `db_url`; yields its base URL once ready."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    with log.open("ab") as out:
        proc = subprocess.Popen(cpool_cmd("gateway", "--db", db_url, "--port", str(port)),
                                stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, f"gateway exited:\n{log.read_text()}"
            try:
                return httpx.get(f"{base}/readyz", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, 30, "the gateway process")
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
