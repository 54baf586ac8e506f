"""Only the gateway may use a replica, on a real pool (`cpool up`, a root agent, tenant users): the
replica (simengine.py, run by the agent as its tenant's user) listens on the node's network, where
any job can reach its port, but it answers /v1 only to who shows its key, CPOOL_SERVICE_KEY. The
gateway does, so the service serves; a job of another tenant on the same node, and one of the same
tenant, calling the port directly, get 401; and no listing of the allocations shows the key."""

from __future__ import annotations

import ipaddress
import json
import os
import sqlite3
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import JOB_PYTHON, Pool, cpool, job_readable_copy, local_pool, wait_for

import computepool
from computepool.agent.tenants import remove_tenant_user

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent"),
]
# a copy jobs can read wherever the checkout is (their sandbox hides /tmp)
SIMENGINE = job_readable_copy(Path(computepool.__file__).parent / "serving" / "simengine.py")

# run as a job: call the replica's port directly, as any process on the node could
PROBE = r"""
import json, sys, urllib.error, urllib.request
base, key = sys.argv[1], sys.argv[2]
def status(method, path, auth=None):
    body = json.dumps({"model": "chat", "prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(base + path, data=body if method == "POST" else None, method=method)
    req.add_header("Content-Type", "application/json")
    if auth:
        req.add_header("Authorization", auth)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except urllib.error.URLError:
        return "unreachable"
print(json.dumps({
    "health": status("GET", "/health"),
    "models": status("GET", "/v1/models"),
    "completion": status("POST", "/v1/completions"),
    "chat, a pool token": status("POST", "/v1/chat/completions", "Bearer " + key),
}), flush=True)
"""


@pytest.fixture
def pool_and_env(tmp_path: Path) -> Iterator[tuple[dict[str, str], Pool]]:
    with local_pool(tmp_path) as (env, pool):
        yield env, pool


@pytest.fixture
def other_tenant(pool_and_env: tuple[dict[str, str], Pool]) -> Iterator[tuple[httpx.Client, str]]:
    """A second tenant with one member: a client with its token, and the token."""
    pool, tenant = pool_and_env[1], f"ko{uuid.uuid4().hex[:6]}"
    assert pool.http.post("/api/v1/tenants", json={"name": tenant}).status_code == 201
    try:
        r = pool.http.post("/api/v1/users", json={"name": f"m-{tenant}", "tenant": tenant, "role": "member"})
        assert r.status_code == 201, r.text
        token = str(pool.http.post("/api/v1/tokens", json={"user": f"m-{tenant}"}).json()["token"])
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=pool.url, verify=pool.verify, timeout=10, headers=headers) as client:
            yield client, token
    finally:
        remove_tenant_user(tenant)


def stored_key(db_path: Path, alloc_id: int) -> str:
    """The key the replica was given, as the control plane stores it (the test runs as root)."""
    db = sqlite3.connect(db_path)
    try:
        row = db.execute("SELECT env FROM allocations WHERE id = ?", (alloc_id,)).fetchone()
    finally:
        db.close()
    return str(json.loads(row[0])["CPOOL_SERVICE_KEY"])


def probe_as_job(client: httpx.Client, endpoint: str, bearer: str) -> dict[str, Any]:
    """Run PROBE as a job of the client's tenant; what it found."""
    job = {"command": [JOB_PYTHON, "-c", PROBE, endpoint, bearer], "cpu_milli": 100}
    r = client.post("/api/v1/allocations", json=job)
    assert r.status_code == 201, r.text
    path = f"/api/v1/allocations/{r.json()['id']}"
    state = wait_for("the probe job", lambda: client.get(path).json()["state"] in ("released", "failed"), 60)
    logs = client.get(f"{path}/logs").json()
    assert state and client.get(path).json()["state"] == "released", logs
    return dict(json.loads(logs["stdout"]["data"].strip().splitlines()[-1]))


def test_only_the_gateway_may_use_a_replica(
    tmp_path: Path, pool_and_env: tuple[dict[str, str], Pool], other_tenant: tuple[httpx.Client, str]
) -> None:
    env, pool = pool_and_env
    command = [JOB_PYTHON, str(SIMENGINE), "--slots", "2", "--ms-per-token", "1"]
    spec = {"request": {"command": command, "cpu_milli": 200}, "min_replicas": 1, "max_replicas": 1,
            "startup_grace_s": 120, "drain_s": 5}  # fmt: skip
    r = pool.http.put("/api/v1/services/chat", json={"spec": spec})
    assert r.status_code == 201, r.text

    def show() -> str:
        return pool.http.get("/api/v1/services/chat").text

    def ready() -> dict[str, Any] | None:
        reps = pool.http.get("/api/v1/services/chat").json()["replicas"]
        return reps[0] if reps and reps[0]["replica_state"] == "ready" else None

    # ready: the controller's health check reached it; through the gateway it serves
    replica = wait_for("a ready replica", ready, 90, show)
    endpoint, alloc_id, token = replica["endpoint"], int(replica["allocation_id"]), env["CPOOL_TOKEN"]
    gw = httpx.Client(base_url=pool.url, verify=pool.verify, timeout=60,
                      headers={"Authorization": f"Bearer {token}"})  # fmt: skip
    with gw:
        r = gw.post("/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    key = stored_key(tmp_path / "pool" / "pool.db", alloc_id)
    assert len(key) >= 43
    assert httpx.get(f"{endpoint}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200

    # a process on the node's network (as a replica, gang member or function worker is) calling the
    # port directly reaches it (its health path answers) but /v1 refuses it without the key
    want = {"health": 200, "models": 401, "completion": 401, "chat, a pool token": 401}
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    on_node = subprocess.run(
        [*nobody, JOB_PYTHON, "-c", PROBE, endpoint, token], capture_output=True, text=True, timeout=60
    )
    assert json.loads(on_node.stdout.strip().splitlines()[-1]) == want, on_node.stderr
    # plain jobs, of another tenant and of the service's own, have networks of their own: the node's
    # loopback (where this pool's replicas listen) is out of their reach; elsewhere /v1 refuses them
    loopback = ipaddress.ip_address(httpx.URL(endpoint).host).is_loopback
    from_jobs = dict.fromkeys(want, "unreachable") if loopback else want
    stranger, stranger_token = other_tenant
    assert probe_as_job(stranger, endpoint, stranger_token) == from_jobs
    assert probe_as_job(pool.http, endpoint, token) == from_jobs

    # no listing shows the key: the API's, and `cpool ps --json`
    one = pool.get(alloc_id)
    assert one["env"]["CPOOL_SERVICE_KEY"] == "(hidden)"
    ps = subprocess.run(cpool("ps", "--json"), capture_output=True, text=True, env=env, timeout=60)
    assert ps.returncode == 0, ps.stderr
    assert any(a["id"] == alloc_id and a["name"] == "svc-chat" for a in json.loads(ps.stdout)), ps.stdout
    for text in (json.dumps(one), pool.http.get("/api/v1/allocations").text, ps.stdout, show()):
        assert key not in text

    assert pool.http.delete("/api/v1/services/chat").status_code == 200
    wait_for("the replica drained", lambda: pool.state(alloc_id) == "released", 30, show)
