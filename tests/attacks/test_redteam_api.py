"""A member of tenant B names tenant A's things in every route of a real server with a root agent.

Tenant A runs a job (an environment secret, a line of output, a file in its work dir), asks for that
file back, uploads a blob, registers a function with a waiting call and declares a service. B then
sends each of those ids and names to every route that takes one: reading, long-polling, asking for
files, cancelling, releasing, deleting, calling, the gateway by A's service name, the dashboard's
page of A's allocation, the routes of nodes and workers. Every answer must be the one a missing
thing gets (the same status, the same words but for the id), carry none of A's secrets, and A's
job, function and service must be untouched afterwards.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from e2e_helpers import wait_for
from job_node import Node, job_node

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent")]

MISSING = 987654  # an id no test makes


@dataclass
class Victim:
    tenant: str
    client: httpx.Client
    alloc: int
    file_request: int
    blob: str
    function: int
    call: int
    service: str
    secrets: tuple[str, ...]


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with job_node() as n:
        yield n


@pytest.fixture(scope="module")
def victim(node: Node) -> Victim:
    tenant, a = node.member("va")
    tag = uuid.uuid4().hex[:8]
    secrets = (f"env-{tag}", f"log-{tag}", f"file-{tag}", f"blob-{tag}")
    script = f"echo {secrets[1]}; echo {secrets[2]} > notes.txt; sleep 600"
    alloc = node.submit(a, ["/bin/sh", "-c", script], env={"A_SECRET": secrets[0]}, name=f"a-{tag}")
    wait_for(
        "A's job", lambda: a.get(f"/api/v1/allocations/{alloc}").json()["state"] == "active", 60, node.logs
    )
    wait_for(
        "A's output",
        lambda: secrets[1] in a.get(f"/api/v1/allocations/{alloc}/logs").json()["stdout"]["data"],
        60,
        node.logs,
    )
    r = a.post(f"/api/v1/allocations/{alloc}/files", json={"path": "notes.txt"})
    assert r.status_code == 201, r.text
    blob = secrets[3].encode()
    sha = hashlib.sha256(blob).hexdigest()
    assert a.put(f"/api/v1/blobs/{sha}", content=blob).status_code == 201
    fn = a.post("/api/v1/functions", json={"name": f"f{tag}", "request": {"command": ["/bin/false"]}})
    assert fn.status_code == 201, fn.text
    calls = a.post(f"/api/v1/functions/{fn.json()['id']}/calls", json={"calls": [{"args": "eA=="}]})
    assert calls.status_code == 200, calls.text
    spec = {
        "request": {"command": ["/bin/sleep", "600"], "cpu_milli": 100},
        "min_replicas": 0,
        "max_replicas": 1,
    }
    svc = a.put(f"/api/v1/services/s{tag}", json={"spec": spec})
    assert svc.status_code == 201, svc.text
    return Victim(
        tenant, a, alloc, int(r.json()["id"]), sha, int(fn.json()["id"]), int(calls.json()["ids"][0]),
        f"s{tag}", secrets,
    )  # fmt: skip


def _routes(
    v: Victim, alloc: int, rid: int, fid: int, cid: int, svc: str, tenant: str
) -> list[tuple[str, str, Any]]:
    """(method, path, json body) of every route that names one of these."""
    chat = {"model": svc, "messages": [{"role": "user", "content": "hi"}]}
    return [
        ("GET", f"/api/v1/allocations/{alloc}", None),
        ("GET", f"/api/v1/allocations/{alloc}?wait=0.2", None),
        ("GET", f"/api/v1/allocations/{alloc}/explain", None),
        ("GET", f"/api/v1/allocations/{alloc}/logs", None),
        ("GET", f"/api/v1/allocations/{alloc}/logs?rank=1&wait=0.2", None),
        ("POST", f"/api/v1/allocations/{alloc}/files", {"path": "notes.txt"}),
        ("GET", f"/api/v1/allocations/{alloc}/files/{rid}", None),
        ("POST", f"/api/v1/allocations/{alloc}/cancel", None),
        ("POST", f"/api/v1/allocations/{alloc}/release", None),
        ("GET", f"/api/v1/functions/{fid}", None),
        ("POST", f"/api/v1/functions/{fid}/calls", {"calls": [{"args": "eQ=="}]}),
        ("POST", f"/api/v1/functions/{fid}/results", {"ids": [cid]}),
        ("DELETE", f"/api/v1/functions/{fid}/calls/{cid}", None),
        ("DELETE", f"/api/v1/functions/{fid}", None),
        ("GET", f"/api/v1/services/{svc}", None),
        ("GET", f"/api/v1/services/{svc}/plan", None),
        ("DELETE", f"/api/v1/services/{svc}", None),
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/completions", {"model": svc, "prompt": "hi"}),
        ("POST", "/v1/embeddings", {"model": svc, "input": "hi"}),
        ("GET", f"/api/v1/tenants/{tenant}", None),
        ("GET", f"/api/v1/tenants/{tenant}/quota", None),
        ("GET", f"/api/v1/tenants/{tenant}/defaults", None),
        ("GET", f"/api/v1/tenants/{tenant}/reclaim", None),
        ("GET", f"/api/v1/tenants/{tenant}/gateway-limit", None),
    ]


def _shape(r: httpx.Response, *names: str) -> tuple[int, str]:
    """The status and the text with each quoted name (longest first) written as <x>."""
    text = r.text
    for name in sorted(names, key=len, reverse=True):
        text = text.replace(f"'{name}'", "'<x>'")
    return r.status_code, text


def test_every_route_answers_for_another_tenants_ids_as_for_missing_ones(node: Node, victim: Victim) -> None:
    _, b = node.member("vb")
    v = victim
    real = _routes(v, v.alloc, v.file_request, v.function, v.call, v.service, v.tenant)
    gone = _routes(v, MISSING, MISSING, MISSING, MISSING, "nosuchsvc", "nosuchtenant")
    for (method, path, body), (_, missing_path, missing_body) in zip(real, gone, strict=True):
        got = b.request(method, path, json=body)
        want = b.request(method, missing_path, json=missing_body)
        assert got.status_code in (403, 404), (method, path, got.status_code, got.text)
        names = (str(v.alloc), str(v.file_request), str(v.function), str(v.call), v.service, v.tenant)
        missing = (str(MISSING), "nosuchsvc", "nosuchtenant")
        assert _shape(got, *names) == _shape(want, *missing), (method, path, got.text, want.text)
        assert not [s for s in v.secrets if s in got.text], (method, path, got.text)
    # the blob: B cannot read it, and uploading the same bytes tells B nothing of A's copy
    assert b.get(f"/api/v1/blobs/{v.blob}").status_code == 404
    assert b.put(f"/api/v1/blobs/{v.blob}", content=v.secrets[3].encode()).status_code == 201
    # listings of B's own tenant show nothing of A's
    listings = (
        "/api/v1/allocations", f"/api/v1/allocations?tenant={v.tenant}", "/api/v1/functions",
        "/api/v1/services", "/v1/models", "/api/v1/usage", f"/api/v1/usage?tenant={v.tenant}",
        "/api/v1/tenants", "/api/v1/users", "/api/v1/tokens", "/api/v1/alerts", "/api/v1/gateway/usage",
    )  # fmt: skip
    for path in listings:
        r = b.get(path)
        assert r.status_code in (200, 403), (path, r.text)
        assert v.tenant not in r.text and v.service not in r.text, (path, r.text)
    # the node's and the workers' routes refuse a member outright
    for method, path, body in (
        ("POST", f"/api/v1/allocations/{v.alloc}/logs", {"stream": "stdout", "data": "forged", "offset": 0}),
        ("POST", "/api/v1/worker/next", {}),
        ("POST", "/api/v1/worker/output", {"id": v.call, "data": "forged"}),
        ("GET", "/api/v1/audit", None),
        ("GET", "/metrics", None),
        ("GET", "/api/v1/discovery/key", None),
    ):
        r = b.request(method, path, json=body)
        assert r.status_code == 403, (method, path, r.text)
    # A's work is untouched: the job runs, the call still waits, the service stands
    a = v.client
    assert a.get(f"/api/v1/allocations/{v.alloc}").json()["state"] == "active"
    assert v.secrets[1] in a.get(f"/api/v1/allocations/{v.alloc}/logs").json()["stdout"]["data"]
    assert "forged" not in a.get(f"/api/v1/allocations/{v.alloc}/logs").json()["stdout"]["data"]
    assert a.get(f"/api/v1/functions/{v.function}").status_code == 200
    res = a.post(f"/api/v1/functions/{v.function}/results", json={"ids": [v.call]})
    assert res.status_code == 200 and "forged" not in res.text, res.text
    assert a.get(f"/api/v1/services/{v.service}").status_code == 200


def _page(r: httpx.Response, alloc: int) -> str:
    """The page's main part and the allocation it names, the allocation's number written <x>."""
    main = re.search(r'alloc-id="[0-9]*".*?<main>.*</main>', r.text, re.S)
    assert main is not None, r.text
    text = re.sub(r'name="csrf" value="[0-9a-f]+"', "", main.group(0))
    return re.sub(rf"(?<![0-9a-zA-Z]){alloc}(?![0-9a-zA-Z])", "<x>", text)


def test_the_dashboard_shows_another_tenants_allocation_as_missing(node: Node, victim: Victim) -> None:
    tenant, _ = node.member("vd")
    ui = httpx.Client(base_url=node.url, timeout=30, headers={"Origin": node.url})
    r = ui.post("/ui/login", data={"token": node.tokens[tenant]})
    assert r.status_code == 303 and ui.cookies, r.text
    got, want = ui.get(f"/ui/work/{victim.alloc}"), ui.get(f"/ui/work/{MISSING}")
    assert got.status_code == want.status_code == 404, (got.status_code, want.status_code)
    assert f"allocation &#39;{victim.alloc}&#39; not found" in got.text
    assert _page(got, victim.alloc) == _page(want, MISSING)
    assert not [s for s in victim.secrets if s in got.text]


def test_another_tenants_blob_named_as_code_or_stdin_is_refused_like_an_unknown_one(
    node: Node, victim: Victim
) -> None:
    """The node fetches what a request names with its own credential: the server must refuse, at
    admission, a request, a function's or a service's request naming a blob B never uploaded."""
    _, b = node.member("vc")
    unknown = hashlib.sha256(uuid.uuid4().bytes).hexdigest()
    cmd = ["/bin/sh", "-c", "cat; ls"]
    for field in ("code", "stdin"):
        for path, method, wrap in (
            ("/api/v1/allocations", "POST", lambda req: req),
            ("/api/v1/functions", "POST", lambda req: {"name": "steal", "request": req}),
            ("/api/v1/services/steal", "PUT", lambda req: {"spec": {"request": req, "min_replicas": 1}}),
        ):
            got = b.request(method, path, json=wrap({"command": cmd, "cpu_milli": 100, field: victim.blob}))
            want = b.request(method, path, json=wrap({"command": cmd, "cpu_milli": 100, field: unknown}))
            assert got.status_code == want.status_code == 422, (path, field, got.text)
            assert got.text.replace(victim.blob, "<x>") == want.text.replace(unknown, "<x>"), got.text
    assert b.get("/api/v1/allocations").json()["items"] == []
