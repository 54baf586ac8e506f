"""Model services over HTTP: create, change, list, show, delete; bad input; tenants' scope
(SQLite and PostgreSQL)."""

from __future__ import annotations

from typing import Any

from harness import Api
from test_allocations import join, manual

S = "/api/v1/services"
CMD = ["python3", "-m", "http.server"]


def spec(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "request": {"command": CMD, "cpu_milli": 500},
        "min_replicas": 0,
        "max_replicas": 2,
    }
    body.update(over)
    return body


def put(
    api: Api, name: str, body: dict[str, Any], headers: dict[str, str] | None = None, expect: int = 201
) -> Any:
    r = api.put(f"{S}/{name}", json=body, headers=headers or api.admin)
    assert r.status_code == expect, r.text
    return r.json()


def test_create_change_list_show_delete(api: Api) -> None:
    manual(api)
    api.app.state.service_controller.auto = False
    join(api, "n1")
    out = put(api, "chat", {"spec": spec(target_inflight=3)})
    assert out["name"] == "chat" and out["tenant"] == "default" and out["owner"] == "admin"
    assert out["generation"] == 1 and out["replicas"] == [] and out["ready"] == 0
    assert out["spec"]["target_inflight"] == 3 and out["spec"]["request"]["command"] == CMD
    assert out["spec"]["port_env"] == "PORT" and out["spec"]["health_path"] == "/health"
    # the same spec again: no new generation, 200
    again = put(api, "chat", {"spec": spec(target_inflight=3)}, expect=200)
    assert again["id"] == out["id"] and again["generation"] == 1
    changed = put(api, "chat", {"spec": spec(target_inflight=5)}, expect=200)
    assert changed["generation"] == 2 and changed["spec"]["target_inflight"] == 5
    put(api, "embed", {"spec": spec()})
    names = [s["name"] for s in api.ok("GET", S)["items"]]
    assert names == ["chat", "embed"]
    shown = api.ok("GET", f"{S}/chat")
    assert shown["id"] == out["id"] and shown["generation"] == 2
    gone = api.ok("DELETE", f"{S}/chat")
    assert gone["name"] == "chat" and gone["desired"] == 0 and "deleted" in gone["reason"]
    assert api.get(f"{S}/chat", headers=api.admin).status_code == 404
    assert [s["name"] for s in api.ok("GET", S)["items"]] == ["embed"]
    # the name is free again: a new service, generation 1
    fresh = put(api, "chat", {"spec": spec()})
    assert fresh["id"] != out["id"] and fresh["generation"] == 1
    actions = [r["action"] for r in api.ok("GET", "/api/v1/audit", params={"limit": 500})["items"]]
    assert actions.count("service.put") >= 4 and "service.delete" in actions


def test_bad_input_names_the_field(api: Api) -> None:
    manual(api)
    join(api, "n1")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"spec": spec(min_replicas=3, max_replicas=2)}, "min_replicas 3 is above max_replicas 2"),
        ({"spec": {"request": {"cpu_milli": 100}}}, "request.command"),
        ({"spec": spec(colour="red")}, "spec.colour"),
        ({"spec": spec(), "extra": 1}, "extra"),
        ({"spec": spec(port_env="1BAD")}, "spec.port_env"),
        ({"spec": spec(port_env="CPOOL_SERVICE_KEY")}, "spec.port_env"),  # the pool's own names
        ({"spec": spec(health_path="health")}, "spec.health_path"),
        ({"spec": spec(request={"command": CMD, "gpus": 1, "models": ["H100"]})}, "spec.request.models"),
        ({"spec": spec(request={"command": CMD, "cpu_milli": 999_000})}, "spec.request"),
        ({"spec": spec(request={"command": CMD, "code": "ab" * 32})}, "spec.request.code"),
        ({"spec": spec(max_replicas=65)}, "spec.max_replicas"),
    ]
    for body, field in cases:
        r = api.put(f"{S}/svc", json=body, headers=api.admin)
        assert r.status_code == 422, (body, r.text)
        assert field in r.text, (field, r.text)
    r = api.put(f"{S}/Bad_Name", json={"spec": spec()}, headers=api.admin)
    assert r.status_code == 422 and "name" in r.text
    r = api.put(f"{S}/svc", content=b"not json", headers={**api.admin, "Content-Type": "application/json"})
    assert r.status_code == 422
    assert api.ok("GET", S)["items"] == []  # nothing stored by the refusals


def test_another_tenants_service_is_404_like_a_missing_one(api: Api) -> None:
    manual(api)
    api.app.state.service_controller.auto = False
    join(api, "n1")
    api.tenant("red")
    api.tenant("blue")
    red = api.user("rita", "red", "member")
    blue = api.user("bob", "blue", "member")
    viewer = api.user("vic", "red", "viewer")
    mine = put(api, "chat", {"spec": spec()}, headers=red)
    assert mine["tenant"] == "red" and mine["owner"] == "rita"
    missing = api.get(f"{S}/nothing", headers=blue)
    theirs = api.get(f"{S}/chat", headers=blue)
    assert missing.status_code == theirs.status_code == 404
    assert (
        theirs.json()["error"]
        == "service 'chat' not found"
        == missing.json()["error"].replace("nothing", "chat")
    )
    assert api.get(f"{S}/chat", headers=blue, params={"tenant": "red"}).status_code == 404
    assert api.delete(f"{S}/chat", headers=blue).status_code == 404
    assert api.ok("GET", S, headers=blue)["items"] == []
    # blue's own service of the same name is another service
    other = put(api, "chat", {"spec": spec()}, headers=blue)
    assert other["id"] != mine["id"] and other["tenant"] == "blue"
    assert [s["id"] for s in api.ok("GET", S, headers=red)["items"]] == [mine["id"]]
    # a viewer reads but may not change; a member may not put into another tenant
    assert api.ok("GET", f"{S}/chat", headers=viewer)["id"] == mine["id"]
    assert api.put(f"{S}/chat", json={"spec": spec()}, headers=viewer).status_code == 403
    assert api.put(f"{S}/x", json={"spec": spec(), "tenant": "blue"}, headers=red).status_code == 404
    # the admin sees both, and picks one by tenant
    assert sorted(s["tenant"] for s in api.ok("GET", S)["items"]) == ["blue", "red"]
    assert api.ok("GET", f"{S}/chat", params={"tenant": "blue"})["id"] == other["id"]
    made = put(api, "emb", {"spec": spec(), "tenant": "red"})
    assert made["tenant"] == "red" and made["owner"] == "admin"
    gone = api.ok("DELETE", f"{S}/chat", params={"tenant": "red"})
    assert gone["id"] == mine["id"]
    assert api.ok("GET", f"{S}/chat", headers=blue)["id"] == other["id"]
