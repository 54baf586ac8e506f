"""Tenant B against tenant A's secrets: read, overwrite, delete or use one of A's names. Every try
answers as for a name that does not exist, and A's value reaches only A's jobs."""

from __future__ import annotations

import json

from harness import Api, H
from test_allocations import A, alloc, cycle, join, manual

S = "/api/v1/secrets"
A_VALUE = "a-tenants-token-7c1e9b"
B_VALUE = "b-tenants-own-token-55d0"


def _tenants(api: Api) -> tuple[H, H, H]:
    """A's admin, B's admin, B's member; A holds HF_TOKEN."""
    api.tenant("ta")
    api.tenant("tb")
    a_admin = api.user("aadmin", "ta", "tenant-admin")
    b_admin, b_member = api.user("badmin", "tb", "tenant-admin"), api.user("bmember", "tb", "member")
    api.ok("PUT", f"{S}/HF_TOKEN", json={"value": A_VALUE}, headers=a_admin)
    return a_admin, b_admin, b_member


def _env_on(api: Api, node: H, alloc_id: int) -> dict[str, str]:
    found = api.ok("GET", "/api/v1/nodes/n1/assignments", headers=node)["assignments"]
    return next(dict(x["env"]) for x in found if x["allocation_id"] == alloc_id)


def test_b_cannot_read_overwrite_or_delete_as_secret(api: Api) -> None:
    a_admin, b_admin, b_member = _tenants(api)
    for who in (b_admin, b_member):
        assert api.get(f"{S}/HF_TOKEN", headers=who).status_code == 405  # no route reads a value
        assert api.get(S, headers=who, params={"tenant": "ta"}).status_code == 404
        assert "HF_TOKEN" not in api.get(S, headers=who).text
    over = api.put(f"{S}/HF_TOKEN", json={"value": B_VALUE, "tenant": "ta"}, headers=b_admin)
    assert over.status_code == 404 and over.json()["error"] == "tenant 'ta' not found"
    theirs = api.delete(f"{S}/HF_TOKEN", headers=b_admin)
    never = api.delete(f"{S}/NEVER_SET", headers=b_admin)
    assert theirs.status_code == never.status_code == 404
    assert theirs.json()["error"] == "secret 'HF_TOKEN' not found"
    assert never.json()["error"] == "secret 'NEVER_SET' not found"
    assert api.delete(f"{S}/HF_TOKEN", headers=b_admin, params={"tenant": "ta"}).status_code == 404
    # B's own HF_TOKEN is another secret: A's is unchanged and still listed for A
    api.ok("PUT", f"{S}/HF_TOKEN", json={"value": B_VALUE}, headers=b_admin)
    [mine] = api.ok("GET", S, headers=a_admin)["items"]
    assert mine["set_by"] == "user:aadmin" and mine["updated_at"] == mine["created_at"]
    assert A_VALUE not in json.dumps(api.ok("GET", "/api/v1/audit", params={"limit": 1000}))


def test_b_cannot_use_as_secret(api: Api) -> None:
    manual(api)
    a_admin, b_admin, b_member = _tenants(api)
    node = join(api, "n1")
    refused = api.post(A, json={"command": ["env"], "secrets": [{"name": "HF_TOKEN"}]}, headers=b_member)
    assert refused.status_code == 422 and refused.json()["field"] == "secrets[0]"
    assert refused.json()["error"] == "secrets[0]: unknown secret 'HF_TOKEN' (cpool secrets list)"
    assert A_VALUE not in refused.text
    request = {"command": ["env"], "secrets": [{"name": "HF_TOKEN"}]}
    service = {"spec": {"request": request, "max_replicas": 1}}
    r = api.put("/api/v1/services/bsvc", json=service, headers=b_member)
    assert r.status_code == 422 and "unknown secret 'HF_TOKEN'" in r.text
    # with a secret of the same name of its own, B's job gets B's value, never A's
    api.ok("PUT", f"{S}/HF_TOKEN", json={"value": B_VALUE}, headers=b_admin)
    b_job = alloc(api, b_member, command=["env"], secrets=[{"name": "HF_TOKEN", "env": "TOKEN"}])
    a_job = alloc(api, a_admin, command=["env"], secrets=[{"name": "HF_TOKEN"}])
    cycle(api)
    assert _env_on(api, node, b_job["id"]) == {"TOKEN": B_VALUE}
    assert _env_on(api, node, a_job["id"]) == {"HF_TOKEN": A_VALUE}
