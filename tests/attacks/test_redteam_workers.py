"""A function worker of tenant B against a call of tenant A that A's worker holds, on a real pool.

Every worker job gets a bearer token (CPOOL_WORKER_TOKEN) for the worker routes. A's worker takes
A's call and holds it; B's worker then uses its own token to hand in a result for A's call, to
write output into it, to take calls (hoping for A's), and to read A's function and allocation. The
answers must be those an unknown call gets, B's worker must never be given A's call, and A's call
must end with A's own result and output only.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from collections.abc import Iterator

import httpx
import pytest
from e2e_helpers import JOB_PYTHON, wait_for
from job_node import Node, job_node

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent")]

F = "/api/v1/functions"
MISSING = 987654

# A worker: `hold` takes one call, says so, and hands its result in once told (a file appears in its
# work dir); `attack` tries A's call with its own token and prints what each route answered.
WORKER = r"""
import json, os, sys, time, urllib.request, urllib.error
url, mode = sys.argv[1], sys.argv[2]
token = os.environ["CPOOL_WORKER_TOKEN"]
def call(method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": "Bearer " + token, "Content-Type": "application/json"}
    req = urllib.request.Request(url + path, method=method, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
if mode == "hold":
    status, body = call("POST", "/api/v1/worker/next", {"wait_s": 30})
    cid = json.loads(body)["call"]["id"]
    print("holding", cid, flush=True)
    while not os.path.exists("go"):
        time.sleep(0.2)
    call("POST", "/api/v1/worker/output", {"id": cid, "data": "A's own output"})
    call("POST", "/api/v1/worker/next", {"done": {"id": cid, "ok": True, "result": sys.argv[3]}})
    sys.exit(0)
out = {}
for cid in map(int, sys.argv[3:]):  # A's call, then a call id nobody made
    out[f"output {cid}"] = call("POST", "/api/v1/worker/output", {"id": cid, "data": "forged"})
    forged = {"id": cid, "ok": True, "result": "Zm9yZ2Vk"}
    out[f"done {cid}"] = call("POST", "/api/v1/worker/next", {"done": forged})
    err = {"id": cid, "data": "forged", "stream": "stderr"}
    out[f"stderr {cid}"] = call("POST", "/api/v1/worker/output", err)
out["next"] = call("POST", "/api/v1/worker/next", {"wait_s": 2})
out["function"] = call("GET", "/api/v1/functions/" + os.environ["A_FUNCTION"])
out["allocations"] = call("GET", "/api/v1/allocations")
print(json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with job_node() as n:
        yield n


def _register(client: httpx.Client, name: str, command: list[str], env: dict[str, str] | None = None) -> int:
    request = {"command": command, "cpu_milli": 100, **({"env": env} if env else {})}
    r = client.post(F, json={"name": name, "request": request, "keep_warm_s": 60})
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def test_another_tenants_worker_cannot_answer_write_into_or_take_a_call(node: Node) -> None:
    _, a = node.member("wa")
    _, b = node.member("wb")
    result = base64.b64encode(f"A's result {uuid.uuid4().hex}".encode()).decode()
    fa = _register(a, "held", [JOB_PYTHON, "-c", WORKER, node.url, "hold", result])
    cid = a.post(f"{F}/{fa}/calls", json={"calls": [{"args": "eA=="}]}).json()["ids"][0]

    def holding() -> int | None:
        for item in a.get("/api/v1/allocations").json()["items"]:
            logs = a.get(f"/api/v1/allocations/{item['id']}/logs").json()["stdout"]["data"]
            if f"holding {cid}" in logs:
                return int(item["id"])
        return None

    worker_a = wait_for("A's worker holding A's call", holding, 90, node.logs)
    fb = _register(b, "thief", [JOB_PYTHON, "-c", WORKER, node.url, "attack", str(cid), str(MISSING)],
                   env={"A_FUNCTION": str(fa)})  # fmt: skip
    assert b.post(f"{F}/{fb}/calls", json={"calls": [{"args": "eQ=="}]}).status_code == 200

    def attacked() -> dict[str, list[object]] | None:
        for item in b.get("/api/v1/allocations").json()["items"]:
            lines = b.get(f"/api/v1/allocations/{item['id']}/logs").json()["stdout"]["data"].splitlines()
            if lines and lines[-1].startswith("{"):
                return dict(json.loads(lines[-1]))
        return None

    out = wait_for("B's worker", attacked, 90, node.logs)
    for what in ("output", "done", "stderr"):
        got, missing = out[f"{what} {cid}"], out[f"{what} {MISSING}"]
        assert got[0] == missing[0] == 409, out
        assert str(got[1]).replace(str(cid), "<x>") == str(missing[1]).replace(str(MISSING), "<x>"), out
    status, body = out["next"]
    assert status == 200 and json.loads(str(body))["call"]["args"] == "eQ==", out  # B's own call only
    assert out["function"][0] == 403 and out["allocations"][0] == 403, out
    # A's worker finishes: A's call holds A's result and output, nothing of B's
    work = node.agent_dir / "runs" / str(worker_a) / "1" / "work"
    (work / "go").touch()

    def done() -> dict[str, object] | None:
        calls = a.post(f"{F}/{fa}/results", json={"ids": [cid]}).json()["calls"]
        return dict(calls[0]) if calls and calls[0]["state"] not in ("pending", "running") else None

    call = wait_for("A's call", done, 60, node.logs)
    assert call["ok"] is True and call["result"] == result, call
    assert call["output"] == "A's own output" and call["stderr"] == "", call
