"""Edges of the API: ids no column can hold, one 404 for missing and hidden objects, the body cap.

On SQLite and PostgreSQL alike: an id of 2^63 or more used to answer 500 (SQLite's OverflowError);
another tenant's object used to answer a 404 worded differently from a missing one, which told
the two apart; a request body had no size limit.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import Api
from test_api_auth import _api_routes
from test_server_process import start_server_process, stop_server_process

BIG = (2**63, 2**64, 10**30)
HUMAN_ROLES = ("tenant-admin", "member", "viewer")
MISSING_TOKEN = "0123456789abcdef"


@pytest.fixture
def world(api: Api) -> dict[str, Any]:
    """Tenant a owns an allocation and a token; tenant b has one user of each role; a node exists."""
    api.tenant("a")
    api.tenant("b")
    node = api.join_node("n1")
    api.ok("POST", "/api/v1/nodes/n1/cordon")  # the allocation stays pending: it runs on no node
    owner = api.user("alice", "a", "member")
    alloc = api.ok("POST", "/api/v1/allocations", headers=owner, json={"cpu_milli": 100, "command": ["true"]})
    tokens = api.ok("GET", "/api/v1/tokens")["items"]
    a_token = next(t["id"] for t in tokens if t["user"] == "alice")
    roles = {r: api.user(f"b-{r}", "b", r) for r in HUMAN_ROLES}
    # a function of tenant a (a node providing its Python), one call of it, and a blob of a's
    join = api.ok("POST", "/api/v1/join-tokens", json={})["token"]
    api.ok(
        "POST",
        "/api/v1/nodes/join",
        headers={},
        json={"join_token": join, "name": "py", "cpu_milli": 1000, "memory_mib": 1024, "pythons": ["3.11"]},
    )
    fn = api.ok(
        "POST",
        "/api/v1/functions",
        headers=owner,
        json={"name": "f", "request": {"cpu_milli": 100, "command": ["true"]}, "python": "3.11"},
    )
    [call] = api.ok("POST", f"/api/v1/functions/{fn['id']}/calls", headers=owner, json=CALLS)["ids"]
    # a service of tenant a named like the tenant, so that {name} = "a" names it on the services routes
    api.ok(
        "PUT",
        "/api/v1/services/a",
        headers=owner,
        json={"spec": {"request": {"cpu_milli": 100, "command": ["true"]}, "min_replicas": 0}},
    )
    blob = b"tenant a's bytes"
    sha = hashlib.sha256(blob).hexdigest()
    r = api.request("PUT", f"/api/v1/blobs/{sha}", headers=owner, content=blob)
    assert r.status_code == 201, r.text
    return {
        "alloc": str(alloc["id"]),
        "a_token": a_token,
        "roles": roles,
        "node": node,
        "fid": str(fn["id"]),
        "cid": str(call),
        "sha": sha,
    }


# Every tenant-scoped route with a path parameter: (the other tenant's value, a missing value).
def _cases(w: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {
        "alloc_id": (w["alloc"], "987654"),
        "name": ("a", "nosuch"),
        "token_id": (w["a_token"], MISSING_TOKEN),
        "fid": (w["fid"], "987654"),
        "cid": (w["cid"], "987655"),
        "sha256": (w["sha"], "0" * 64),
        "rid": ("1", "987656"),
    }


CALLS = {"calls": [{"args": "eA=="}]}


BODIES: dict[tuple[str, str], Any] = {
    ("PUT", "/api/v1/tenants/{name}/quota"): {"cpu_milli": {"guaranteed": 1, "limit": 2}},
    ("POST", "/api/v1/allocations/{alloc_id}/logs"): {
        "attempt": 1,
        "stream": "stdout",
        "offset": 0,
        "data": "x",
    },
    ("POST", "/api/v1/functions/{fid}/calls"): CALLS,
    ("POST", "/api/v1/functions/{fid}/results"): {"ids": [1]},
    ("POST", "/api/v1/allocations/{alloc_id}/files"): {"path": "out.txt"},
    ("POST", "/api/v1/allocations/{alloc_id}/relays"): {"kind": "exec", "command": ["true"]},
}
NODE_ROUTES = {("POST", "/api/v1/allocations/{alloc_id}/logs")}
NOT_TENANT_SCOPED = ("/api/v1/nodes/",)  # node names are shared by every tenant: nothing is hidden
# the pool's own settings, an admin's to change, one for every tenant: prices, alert rules, webhooks
NOT_TENANT_SCOPED += ("/api/v1/prices/", "/api/v1/alert-rules/", "/api/v1/webhooks/")
# an upload names bytes the caller sends, held per tenant: it looks up nothing of another's
NOT_LOOKUPS = {("PUT", "/api/v1/blobs/{sha256}")}
# a service's name is the caller's tenant's own: PUT creates it there, it finds nothing of another's
NOT_LOOKUPS.add(("PUT", "/api/v1/services/{name}"))
# so is a secret's (tests/attacks/test_secrets.py: B's PUT of A's name makes B's own)
NOT_LOOKUPS.add(("PUT", "/api/v1/secrets/{name}"))


def _scoped_routes(api: Api) -> list[tuple[str, str]]:
    out = []
    for route in _api_routes(api.app):
        if "{" not in route.path or route.path.startswith(NOT_TENANT_SCOPED):
            continue
        out.extend((m, route.path) for m in sorted(route.methods) if (m, route.path) not in NOT_LOOKUPS)
    return out


def test_hidden_and_missing_objects_answer_the_same_bytes(api: Api, world: dict[str, Any]) -> None:
    cases = _cases(world)
    routes = _scoped_routes(api)
    assert len(routes) >= 9, routes
    callers = {**world["roles"], "node": world["node"]}
    compared = 0
    for method, template in routes:
        params = re.findall(r"\{(\w+)\}", template)
        for name in params:
            assert name in cases, f"no case for {{{name}}} in {template}: add one"
        # the other tenant's objects throughout, against the first one missing
        hidden = {n: cases[n][0] for n in params}
        missing = {**hidden, params[0]: cases[params[0]][1]}
        for role, headers in callers.items():
            answers = []
            for values in (hidden, missing):
                path = template
                for n, v in values.items():
                    path = path.replace("{" + n + "}", v)
                value = values[params[0]]
                r = api.request(method, path, headers=headers, json=BODIES.get((method, template)))
                answers.append((r.status_code, r.content.replace(f"'{value}'".encode(), b"'<id>'")))
            assert answers[0] == answers[1], f"{role} {method} {template}: {answers}"
            assert answers[0][0] in (403, 404), f"{role} {method} {template}: {answers}"
            compared += 1
    assert compared == len(routes) * len(callers)
    # the wording itself: one form for every kind
    r = api.get(f"/api/v1/allocations/{world['alloc']}", headers=world["roles"]["member"])
    assert r.json() == {"error": f"allocation '{world['alloc']}' not found"}


@pytest.mark.parametrize("big", BIG)
def test_huge_ids_answer_404_on_every_id_route(api: Api, world: dict[str, Any], big: int) -> None:
    routes = [(m, p) for m, p in _scoped_routes(api) if "{alloc_id}" in p]
    assert len(routes) >= 6
    for value in (big, -big, 0, -1, int("9" * 4000)):
        for method, template in routes:
            headers = world["node"] if (method, template) in NODE_ROUTES else api.admin
            path = template.replace("{alloc_id}", str(value)).replace("{rid}", "1")
            r = api.request(method, path, headers=headers, json=BODIES.get((method, template)))
            assert r.status_code == 404, f"{method} {path}: {r.status_code} {r.text}"
            assert r.json() == {"error": f"allocation '{value}' not found"}
    # unauthenticated callers still learn nothing but 401
    assert api.get(f"/api/v1/allocations/{big}").status_code == 401


@pytest.mark.parametrize("big", BIG)
def test_ids_beyond_any_column_in_bodies_answer_422(api: Api, world: dict[str, Any], big: int) -> None:
    node = world["node"]
    for report in (
        {"allocation_id": big, "attempt": 1, "state": "running"},
        {"allocation_id": 1, "attempt": big, "state": "running"},
    ):
        r = api.post("/api/v1/nodes/n1/reports", headers=node, json={"reports": [report]})
        assert r.status_code == 422, r.text
        assert r.json()["field"] in ("reports[0].allocation_id", "reports[0].attempt")
    chunk = {"attempt": big, "stream": "stdout", "offset": 0, "data": "x"}
    r = api.post(f"/api/v1/allocations/{world['alloc']}/logs", headers=node, json=chunk)
    assert r.status_code == 422 and r.json()["field"] == "attempt", r.text
    for query in ({"since": big}, {"after": big}):
        path = "/api/v1/nodes/n1/assignments" if "since" in query else "/api/v1/audit"
        r = api.get(path, headers=node if "since" in query else api.admin, params=query)
        assert r.status_code == 422, r.text
    # the store holds nothing odd afterwards: the allocation is as it was
    assert api.ok("GET", f"/api/v1/allocations/{world['alloc']}")["attempt"] == 1


@pytest.fixture
def small_cap_server(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    data = tmp_path / "srv"
    proc, base = start_server_process(data, None, tmp_path / "server.log", "--max-body-bytes", "4096")
    try:
        yield base, {"Authorization": f"Bearer {(data / 'admin-token').read_text().strip()}"}
    finally:
        stop_server_process(proc)


def test_body_cap_answers_413_before_parsing(small_cap_server: tuple[str, dict[str, str]]) -> None:
    base, admin = small_cap_server
    json_type = {**admin, "Content-Type": "application/json"}
    with httpx.Client(base_url=base, timeout=10) as c:
        big = b'{"name": "x", "pad": "' + b"y" * 8000 + b'"}'
        r = c.post("/api/v1/tenants", content=big, headers=json_type)
        assert r.status_code == 413 and r.headers["content-type"] == "application/json"
        assert r.json() == {
            "error": "request body too large: more than 4096 bytes (the server's --max-body-bytes)",
            "field": "body",
        }

        def chunks(n: int, size: int) -> Iterator[bytes]:
            yield from (b" " * size for _ in range(n))

        r = c.post("/api/v1/tenants", content=chunks(8, 1024), headers=json_type)
        assert (
            r.request.headers.get("transfer-encoding") == "chunked"
            and "content-length" not in r.request.headers
        )
        assert r.status_code == 413 and r.json()["field"] == "body"

        # within the cap, chunked or not, the body is read as usual
        def small() -> Iterator[bytes]:
            yield b'{"name": '
            yield b'"chunked"}'

        assert c.post("/api/v1/tenants", content=small(), headers=json_type).status_code == 201
        assert c.post("/api/v1/tenants", json={"name": "plain"}, headers=admin).status_code == 201
        names = {t["name"] for t in c.get("/api/v1/tenants", headers=admin).json()["items"]}
        assert names == {"default", "chunked", "plain"}
    # the CLI refuses a bad cap in one line
    bad = subprocess.run(
        [*_cpool_cmd(), "server", "--max-body-bytes", "10", "--data-dir", str(Path("/nonexistent"))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "max_body_bytes" in bad.stderr and "Traceback" not in bad.stderr


def _cpool_cmd() -> list[str]:
    from test_server_process import _cpool

    return _cpool()
