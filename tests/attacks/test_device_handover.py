"""A hostile tenant's job handles SIGTERM to stay on an exclusive GPU after its allocation ends, so
that it runs beside the next tenant's job on that device for the whole kill grace (or, on a node
that rejoins, beside work the pool placed there meanwhile). The node must see the old job dead
before it starts the next one on that device. A real server and root agent on loopback, one
simulated GPU, the process table read every ~50 ms."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_helpers import JOB_PYTHON, alive, wait_for
from test_one_copy_e2e import Cluster, command, started_cluster
from test_thawed_node_e2e import HANDLER, Sampler, start_agent


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    yield from started_cluster(tmp_path)


def member(cluster: Cluster, prefix: str) -> httpx.Client:
    """A new tenant and a client holding its member's token."""
    assert cluster.pool is not None
    admin = cluster.pool.http
    tenant = f"{prefix}{uuid.uuid4().hex[:6]}"
    assert admin.post("/api/v1/tenants", json={"name": tenant}).status_code == 201
    user = f"m-{tenant}"
    r = admin.post("/api/v1/users", json={"name": user, "tenant": tenant, "role": "member"})
    assert r.status_code == 201, r.text
    r = admin.post("/api/v1/tokens", json={"user": user})
    assert r.status_code == 201, r.text
    return httpx.Client(
        base_url=cluster.url, headers={"Authorization": f"Bearer {r.json()['token']}"}, timeout=10
    )


def submit(client: httpx.Client, cmd: list[str]) -> int:
    r = client.post(
        "/api/v1/allocations", json={"command": cmd, "cpu_milli": 100, "memory_mib": 64, "gpus": 1}
    )
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def test_a_job_that_handles_sigterm_never_shares_its_gpu_with_the_next_tenant(cluster: Cluster) -> None:
    start_agent(cluster, "node-a", kill_grace_s=8)
    attacker, victim = member(cluster, "atk"), member(cluster, "vic")
    tag = uuid.uuid4().hex[:8]
    stays = [JOB_PYTHON, "-c", HANDLER, f"stays-{tag}"]
    nxt = command(f"next-{tag}")
    with Sampler(stays, nxt) as s:
        held = submit(attacker, stays)
        wait_for("the attacker's job running", lambda: s.seen[0], 60, detail=cluster.logs)
        queued = submit(victim, nxt)
        assert victim.get(f"/api/v1/allocations/{queued}").json()["state"] == "pending"
        assert attacker.post(f"/api/v1/allocations/{held}/cancel").status_code == 200
        wait_for("the next tenant's job running", lambda: s.seen[1], 60, detail=cluster.logs)
        [old] = s.seen[0]
        assert not alive(old), "the next tenant's job started while the old one still ran"
    assert s.max_together == 1, "two tenants' jobs ran at once on one exclusive GPU"
    log = (cluster.root / "node-a.log").read_text()
    assert log.index(f"{held}#1 ended") < log.index(f"{queued}#1 started"), log
    assert victim.post(f"/api/v1/allocations/{queued}/cancel").status_code == 200
    wait_for("the next job stopped", lambda: not any(alive(p) for p in s.seen[1]), 30)
