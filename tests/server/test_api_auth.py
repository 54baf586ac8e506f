"""Authentication on every route, the declared-policy route walk, the role matrix, tenant isolation."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
from conftest import Api
from fastapi.routing import APIRoute

from computepool.server.app import API_PREFIX
from computepool.server.deps import ACTION_ATTR
from computepool.server.policy import GRANTS, Action
from computepool.server.routers import api_routers


def _declared_actions(route: APIRoute) -> list[Action]:
    found: list[Action] = []
    stack = list(route.dependant.dependencies)
    while stack:
        dep = stack.pop()
        action = getattr(dep.call, ACTION_ATTR, None)
        if action is not None:
            found.append(action)
        stack.extend(dep.dependencies)
    return found


def _api_routes(app: Any) -> list[APIRoute]:
    """Routes of the routers mounted under /api/v1, with the prefix, plus any added to the app itself."""
    found = [r for r in app.routes if isinstance(r, APIRoute) and r.path.startswith(API_PREFIX)]
    for router in api_routers():
        for r in router.routes:
            assert isinstance(r, APIRoute), r
            flat = copy.copy(r)
            flat.path = API_PREFIX + r.path
            found.append(flat)
    return found


def test_every_api_route_declares_one_policy(api: Api) -> None:
    routes = _api_routes(api.app)
    assert len(routes) >= 20
    missing = [f"{sorted(r.methods)} {r.path}" for r in routes if len(_declared_actions(r)) != 1]
    assert not missing, f"routes without exactly one declared action: {missing}"
    assert {a for r in routes for a in _declared_actions(r)} <= set(GRANTS)
    # nothing under /api/v1 is served that the walk did not see (the OpenAPI document lists all)
    walked = {(m.lower(), r.path) for r in routes for m in r.methods}
    served = {(m, p) for p, ops in api.get("/openapi.json").json()["paths"].items() for m in ops}
    assert {op for op in served if op[1].startswith(API_PREFIX)} == walked


FAKE_TOKEN = "0123456789abcdef." + "A" * 43


def test_every_api_route_needs_a_token(api: Api) -> None:
    bad_tokens: list[dict[str, str]] = [
        {},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer nonsense"},
        {"Authorization": f"Bearer {FAKE_TOKEN}"},
        {"Authorization": "Basic YWRtaW46YWRtaW4="},
    ]
    for route in _api_routes(api.app):
        path = re.sub(r"\{[^}]+\}", "x", route.path)
        for method in route.methods:
            for headers in bad_tokens:
                body: Any = None
                if route.path == "/api/v1/nodes/join":
                    # authenticated by the join token in the body instead
                    body = {"join_token": FAKE_TOKEN, "name": "n", "cpu_milli": 1, "memory_mib": 1}
                r = api.request(method, path, headers=headers, json=body)
                assert r.status_code == 401, f"{method} {path} with {headers}: {r.status_code} {r.text}"
                assert method == "HEAD" or "error" in r.json()  # a HEAD answer has no body
                if route.path != "/api/v1/nodes/join":
                    assert r.headers.get("www-authenticate") == "Bearer"


def test_health_endpoints_need_no_token(api: Api) -> None:
    assert api.get("/healthz").json() == {"status": "ok"}
    assert api.get("/readyz").status_code == 200
    doc = api.get("/openapi.json").json()
    assert "/api/v1/tenants" in doc["paths"]


ROLES = ("admin", "tenant-admin", "member", "viewer", "node")


@pytest.fixture
def pool(api: Api) -> dict[str, Any]:
    """Tenants a and b; one user per role in a; a node; a member in b."""
    api.tenant("a")
    api.tenant("b")
    heads = {
        "admin": api.admin,
        "tenant-admin": api.user("ta", "a", "tenant-admin"),
        "member": api.user("ma", "a", "member"),
        "viewer": api.user("va", "a", "viewer"),
        "node": api.join_node("n1"),
    }
    api.user("mb", "b", "member")
    return heads


# (method, path, body, expected status per role: admin, tenant-admin, member, viewer, node)
MATRIX: list[tuple[str, str, Any, tuple[int, int, int, int, int]]] = [
    ("GET", "/api/v1/whoami", None, (200, 200, 200, 200, 200)),
    ("POST", "/api/v1/tenants", {"name": "c{i}"}, (201, 403, 403, 403, 403)),
    ("GET", "/api/v1/tenants", None, (200, 200, 200, 200, 403)),
    ("GET", "/api/v1/tenants/a", None, (200, 200, 200, 200, 403)),
    ("GET", "/api/v1/tenants/b", None, (200, 404, 404, 404, 403)),
    ("POST", "/api/v1/users", {"name": "u{i}", "tenant": "a", "role": "member"}, (201, 201, 403, 403, 403)),
    ("POST", "/api/v1/users", {"name": "w{i}", "tenant": "a", "role": "admin"}, (201, 403, 403, 403, 403)),
    ("POST", "/api/v1/users", {"name": "x{i}", "tenant": "b", "role": "member"}, (201, 404, 403, 403, 403)),
    ("GET", "/api/v1/users", None, (200, 200, 200, 200, 403)),
    ("POST", "/api/v1/tokens", {}, (201, 201, 201, 403, 403)),
    ("POST", "/api/v1/tokens", {"user": "ma"}, (201, 201, 201, 403, 403)),
    ("POST", "/api/v1/tokens", {"user": "va"}, (201, 201, 403, 403, 403)),
    ("POST", "/api/v1/tokens", {"user": "admin"}, (201, 404, 404, 403, 403)),
    ("POST", "/api/v1/tokens", {"user": "mb"}, (201, 404, 404, 403, 403)),
    ("GET", "/api/v1/tokens", None, (200, 200, 200, 200, 403)),
    ("PUT", "/api/v1/tenants/a/quota", {"cpu_milli": {"guaranteed": 1, "limit": 2}}, (200, *[403] * 4)),
    ("GET", "/api/v1/tenants/a/quota", None, (200, 200, 200, 200, 403)),
    ("GET", "/api/v1/tenants/b/quota", None, (200, 404, 404, 404, 403)),
    ("POST", "/api/v1/join-tokens", {}, (201, 403, 403, 403, 403)),
    ("GET", "/api/v1/nodes", None, (200, 200, 200, 200, 403)),
    ("POST", "/api/v1/nodes/n1/heartbeat", {}, (403, 403, 403, 403, 200)),
    ("POST", "/api/v1/nodes/n1/cordon", None, (200, 403, 403, 403, 403)),
    ("GET", "/api/v1/discovery/key", None, (403, 403, 403, 403, 200)),
    ("PUT", "/api/v1/nodes/n1/peers", {"peers": []}, (403, 403, 403, 403, 200)),
    ("GET", "/api/v1/peers", None, (200, 200, 200, 200, 403)),
    ("POST", "/api/v1/nodes/n1/uncordon", None, (200, 403, 403, 403, 403)),
    ("POST", "/api/v1/nodes/n1/drain", None, (200, 403, 403, 403, 403)),
    ("GET", "/api/v1/audit", None, (200, 200, 403, 403, 403)),
    ("GET", "/api/v1/audit/verify", None, (200, 403, 403, 403, 403)),
]


def test_role_matrix(api: Api, pool: dict[str, Any]) -> None:
    wrong = []
    i = 0
    for method, path, body, expected in MATRIX:
        for role, want in zip(ROLES, expected, strict=True):
            i += 1
            payload = {k: v.format(i=i) if isinstance(v, str) else v for k, v in (body or {}).items()}
            r = api.request(method, path, headers=pool[role], json=payload if body is not None else None)
            if r.status_code != want:
                got = f"{r.status_code} (want {want}) {r.text[:120]}"
                wrong.append(f"{role}: {method} {path} {payload} → {got}")
    assert not wrong, "\n".join(wrong)


def test_tenant_isolation_answers_404(api: Api, pool: dict[str, Any]) -> None:
    ta = pool["tenant-admin"]
    hidden = api.get("/api/v1/tenants/b", headers=ta)
    missing = api.get("/api/v1/tenants/nosuch", headers=ta)
    assert hidden.status_code == missing.status_code == 404
    assert hidden.json() == {"error": "tenant 'b' not found"}
    # another tenant's user's token: 404, and the same answer as for a token that does not exist
    tok_b = api.ok("POST", "/api/v1/tokens", json={"user": "mb"})["id"]
    assert api.delete(f"/api/v1/tokens/{tok_b}", headers=ta).status_code == 404
    assert api.delete(f"/api/v1/tokens/{tok_b}", headers=pool["member"]).status_code == 404
    # lists are scoped
    assert {t["name"] for t in api.ok("GET", "/api/v1/tenants", headers=ta)["items"]} == {"a"}
    assert {u["tenant"] for u in api.ok("GET", "/api/v1/users", headers=ta)["items"]} == {"a"}
    toks = api.ok("GET", "/api/v1/tokens", headers=ta)["items"]
    assert toks and all(t["user"] in {"ta", "ma", "va"} for t in toks)
    assert {t["user"] for t in api.ok("GET", "/api/v1/tokens", headers=pool["member"])["items"]} == {"ma"}
    audit = api.ok("GET", "/api/v1/audit", headers=ta)["items"]
    assert audit and {r["tenant"] for r in audit} == {"a"}
    assert api.ok("GET", "/api/v1/audit?tenant=b", headers=ta)["items"] == []


def test_member_cannot_touch_teammates_tokens_but_tenant_admin_can(api: Api, pool: dict[str, Any]) -> None:
    va_tok = api.ok("POST", "/api/v1/tokens", json={"user": "va"})["id"]
    assert api.delete(f"/api/v1/tokens/{va_tok}", headers=pool["member"]).status_code == 403
    assert api.delete(f"/api/v1/tokens/{va_tok}", headers=pool["tenant-admin"]).status_code == 200
    admin_tok = api.ok("POST", "/api/v1/tokens", json={"name": "spare"})["id"]
    assert api.delete(f"/api/v1/tokens/{admin_tok}", headers=pool["tenant-admin"]).status_code == 404


def test_viewer_may_revoke_its_own_token(api: Api, pool: dict[str, Any]) -> None:
    me = api.ok("GET", "/api/v1/whoami", headers=pool["viewer"])
    assert me["role"] == "viewer" and me["tenant"] == "a"
    assert api.delete(f"/api/v1/tokens/{me['token_id']}", headers=pool["viewer"]).status_code == 200
    assert api.get("/api/v1/whoami", headers=pool["viewer"]).status_code == 401
