"""Tenants' secrets: set by the tenant's admins, listed by name, sealed at rest, given to jobs only
in the node's assignment, and never answered back or written to the audit log."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import test_functions_api as fn_api
from harness import Api, H
from sqlalchemy import select
from test_allocations import A, alloc, cycle, get, join, manual

from computepool.server.secret_box import SecretBox, prepare
from computepool.store.db import Database
from computepool.store.models import Secret

S = "/api/v1/secrets"
VALUE = "hf_Zx8sUPERsecretVALUE41"


def _people(api: Api) -> dict[str, H]:
    api.tenant("ta")
    api.tenant("tb")
    return {
        "a-admin": api.user("aadmin", "ta", "tenant-admin"),
        "a-member": api.user("amember", "ta", "member"),
        "a-viewer": api.user("aviewer", "ta", "viewer"),
        "b-admin": api.user("badmin", "tb", "tenant-admin"),
        "b-member": api.user("bmember", "tb", "member"),
    }


def _everything_said(api: Api) -> str:
    """Every answer a user can get about allocations and secrets, and the whole audit log."""
    said = [
        api.get(A, headers=api.admin, params={"events": "true"}).text,
        api.get(S, headers=api.admin, params={"tenant": "ta"}).text,
        api.get("/api/v1/audit", headers=api.admin, params={"limit": 1000}).text,
    ]
    return "\n".join(said)


def test_set_list_delete_by_role_and_tenant(api: Api) -> None:
    who = _people(api)
    r = api.put(f"{S}/HF_TOKEN", json={"value": VALUE}, headers=who["a-admin"])
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["name"] == "HF_TOKEN" and out["tenant"] == "ta" and out["set_by"] == "user:aadmin"
    assert VALUE not in r.text
    for role in ("a-member", "a-viewer", "b-member"):  # only admins change secrets
        assert api.put(f"{S}/HF_TOKEN", json={"value": "x"}, headers=who[role]).status_code == 403
        assert api.delete(f"{S}/HF_TOKEN", headers=who[role]).status_code == 403
    listed = api.ok("GET", S, headers=who["a-member"])["items"]
    assert [s["name"] for s in listed] == ["HF_TOKEN"] and VALUE not in json.dumps(listed)
    assert api.ok("GET", S, headers=who["b-admin"])["items"] == []  # another tenant's: not there
    # another tenant's secret answers as a missing one, word for word
    theirs = api.delete(f"{S}/HF_TOKEN", headers=who["b-admin"])
    missing = api.delete(f"{S}/NO_SUCH", headers=who["b-admin"])
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json()["error"].replace("HF_TOKEN", "X") == missing.json()["error"].replace("NO_SUCH", "X")
    assert api.put(f"{S}/T", json={"value": "v", "tenant": "ta"}, headers=who["b-admin"]).status_code == 404
    assert api.get(S, headers=who["b-admin"], params={"tenant": "ta"}).status_code == 404
    # the pool's admin sets its own tenant's, or names another
    assert api.ok("PUT", f"{S}/T", json={"value": "v"})["tenant"] == "default"
    assert api.put(f"{S}/T", json={"value": "v", "tenant": "ta"}, headers=api.admin).status_code == 200
    assert api.ok("DELETE", f"{S}/T", params={"tenant": "ta"})["name"] == "T"
    # bad input: 422 naming the field
    assert api.put(f"{S}/HF_TOKEN", json={"value": ""}, headers=who["a-admin"]).json()["field"] == "value"
    assert api.put(f"{S}/HF_TOKEN", json={"value": "a\x00b"}, headers=who["a-admin"]).status_code == 422
    assert api.put(f"{S}/bad%20name", json={"value": "v"}, headers=who["a-admin"]).status_code == 422
    # replacing and deleting
    again = api.ok("PUT", f"{S}/HF_TOKEN", json={"value": VALUE + "2"}, headers=who["a-admin"])
    assert again["created_at"] == out["created_at"] and again["updated_at"] >= out["updated_at"]
    assert api.ok("DELETE", f"{S}/HF_TOKEN", headers=who["a-admin"])["name"] == "HF_TOKEN"
    assert api.delete(f"{S}/HF_TOKEN", headers=who["a-admin"]).status_code == 404
    said = _everything_said(api)
    assert VALUE not in said and '"value"' not in said  # audited, never with the value
    actions = [r["action"] for r in api.ok("GET", "/api/v1/audit", params={"limit": 1000})["items"]]
    assert actions.count("secret.set") >= 3 and actions.count("secret.delete") >= 2


def test_sealed_at_rest_bound_to_tenant_and_key(api: Api, tmp_path: Path) -> None:
    who = _people(api)
    api.ok("PUT", f"{S}/HF_TOKEN", json={"value": VALUE}, headers=who["a-admin"])
    key = api.settings.secrets_key_path
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    db: Database = api.app.state.db
    with db.read() as s:
        row = s.scalars(select(Secret)).one()
        assert VALUE not in row.ciphertext and VALUE.encode().hex() not in row.ciphertext
        box = SecretBox.load(key)
        assert box.open(row.tenant_id, row.name, row.ciphertext) == VALUE
        with pytest.raises(Exception, match="does not open"):  # moved to another tenant's row
            box.open(row.tenant_id + 1, row.name, row.ciphertext)
    other = tmp_path / "other-key"
    with pytest.raises(RuntimeError, match="share one secrets key file"):  # a replica with another key
        prepare(db, other)
    prepare(db, key)


def test_node_gets_the_value_readers_never_do(api: Api) -> None:
    manual(api)
    who = _people(api)
    n1 = join(api, "n1")
    api.ok("PUT", f"{S}/HF_TOKEN", json={"value": VALUE}, headers=who["a-admin"])
    job = alloc(
        api,
        who["a-member"],
        command=["sh", "-c", "true"],
        env={"PLAIN": "1"},
        secrets=[{"name": "HF_TOKEN"}, {"name": "HF_TOKEN", "env": "OTHER_NAME"}],
    )
    assert job["request"]["secrets"] == [
        {"name": "HF_TOKEN", "env": "HF_TOKEN"},
        {"name": "HF_TOKEN", "env": "OTHER_NAME"},
    ]
    cycle(api)
    [asg] = api.ok("GET", "/api/v1/nodes/n1/assignments", headers=n1)["assignments"]
    assert asg["env"] == {"PLAIN": "1", "HF_TOKEN": VALUE, "OTHER_NAME": VALUE}
    shown = get(api, job["id"], who["a-member"])
    assert shown["state"] == "bound" and shown["env"] == {"PLAIN": "1"}
    assert VALUE not in json.dumps(shown) and VALUE not in _everything_said(api)
    # in use: not deleted from under the job; a new value is what the next start gets
    gone = api.delete(f"{S}/HF_TOKEN", headers=who["a-admin"])
    assert gone.status_code == 409 and f"allocation {job['id']}" in gone.json()["error"]
    api.ok("PUT", f"{S}/HF_TOKEN", json={"value": "rotated"}, headers=who["a-admin"])
    [asg] = api.ok("GET", "/api/v1/nodes/n1/assignments", headers=n1)["assignments"]
    assert asg["env"]["HF_TOKEN"] == "rotated"
    api.ok("POST", f"{A}/{job['id']}/cancel", headers=who["a-member"])
    assert api.delete(f"{S}/HF_TOKEN", headers=who["a-admin"]).status_code == 200


@pytest.mark.parametrize(
    ("secrets", "env", "message"),
    [
        ([{"name": "NOPE"}], None, "secrets[0]: unknown secret 'NOPE'"),
        ([{"name": "K"}, {"name": "NOPE"}], None, "secrets[1]: unknown secret 'NOPE'"),
        ([{"name": "K", "env": "CPOOL_WORKER_TOKEN"}], None, "set by the pool"),
        ([{"name": "CPOOL_K"}], None, "set by the pool"),
        ([{"name": "my-key"}], None, "not a variable name"),
        ([{"name": "K"}], {"K": "plain"}, "set twice"),
        ([{"name": "K", "env": "bad-var"}], None, "secrets[0].env"),
    ],
)
def test_bad_uses_are_422_naming_the_secret(
    api: Api, secrets: list[dict[str, str]], env: dict[str, str] | None, message: str
) -> None:
    api.tenant("ta")
    member = api.user("amember", "ta", "member")
    for name in ("K", "CPOOL_K", "my-key"):
        api.ok("PUT", f"{S}/{name}", json={"value": "v", "tenant": "ta"})
    body = {"command": ["true"], "secrets": secrets} | ({"env": env} if env else {})
    r = api.post(A, json=body, headers=member)
    assert r.status_code == 422 and message in r.json()["error"], r.text
    assert r.json()["field"].startswith("secrets[")


def test_a_service_names_secrets_and_holds_them(api: Api) -> None:
    manual(api)
    api.app.state.service_controller.auto = False
    who = _people(api)
    api.ok("PUT", f"{S}/HF_TOKEN", json={"value": VALUE}, headers=who["a-admin"])
    request = {"command": ["sh", "-c", "true"], "secrets": [{"name": "HF_TOKEN"}]}
    out = api.ok("PUT", "/api/v1/services/chat", json={"spec": {"request": request}}, headers=who["a-member"])
    assert out["spec"]["request"]["secrets"] == [{"name": "HF_TOKEN", "env": None}] and VALUE not in str(out)
    held = api.delete(f"{S}/HF_TOKEN", headers=who["a-admin"])
    assert held.status_code == 409 and "service chat" in held.json()["error"]
    api.ok("DELETE", "/api/v1/services/chat", headers=who["a-member"])
    assert api.delete(f"{S}/HF_TOKEN", headers=who["a-admin"]).status_code == 200


def test_a_functions_workers_get_its_secrets(api: Api) -> None:
    manual(api)
    who = _people(api)
    node = fn_api.join(api, "n1", ["3.11"])
    api.ok("PUT", f"{S}/HF_TOKEN", json={"value": VALUE}, headers=who["a-admin"])
    request = {"cpu_milli": 500, "command": fn_api.CMD, "secrets": [{"name": "NOPE"}]}
    r = api.post(fn_api.F, json={"name": "f", "request": request, "python": "3.11"}, headers=who["a-member"])
    assert r.status_code == 422 and "unknown secret 'NOPE'" in r.json()["error"], r.text
    request["secrets"] = [{"name": "HF_TOKEN", "env": "TOKEN"}]
    fid = fn_api.register(api, who["a-member"], request=request)["id"]
    fn_api.submit(api, fid, b"x", headers=who["a-member"])
    cycle(api)
    [worker] = api.ok("GET", "/api/v1/nodes/n1/assignments", headers=node)["assignments"]
    assert worker["env"]["TOKEN"] == VALUE and "CPOOL_WORKER_TOKEN" in worker["env"]
    assert VALUE not in _everything_said(api) and VALUE not in api.get(fn_api.F, headers=who["a-member"]).text
