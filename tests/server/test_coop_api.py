"""Cooperative services over HTTP (SQLite and PostgreSQL): the plan route's scope (404 for another
tenant's and for a service that is not cooperative, exactly like a missing one), the spec's checks,
the service controller running no replica before the coop controller wrote the head's command, and
the `cpool.io/node` label every node carries so that allocations can be pinned to it."""

from __future__ import annotations

from typing import Any

from harness import Api
from test_allocations import join, manual

S = "/api/v1/services"


def coop_spec(**over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "request": {"cpu_milli": 1000},
        "cooperative": {"model": "/var/tmp/models/tiny.gguf"},
        "health_path": "/health",
    }
    body.update(over)
    return body


def put(
    api: Api, name: str, spec: dict[str, Any], headers: dict[str, str] | None = None, expect: int = 201
) -> Any:
    r = api.put(f"{S}/{name}", json={"spec": spec}, headers=headers or api.admin)
    assert r.status_code == expect, r.text
    return r.json()


def quiet(api: Api) -> None:
    manual(api)
    api.app.state.service_controller.auto = False
    api.app.state.coop_controller.auto = False


def test_the_plan_is_seen_like_the_service_and_only_for_cooperative_ones(api: Api) -> None:
    quiet(api)
    join(api, "n1")
    api.tenant("red")
    api.tenant("blue")
    red = api.user("rita", "red", "member")
    blue = api.user("bob", "blue", "member")
    viewer = api.user("vic", "red", "viewer")
    made = put(api, "big", coop_spec(), headers=red)
    assert made["spec"]["cooperative"]["model"] == "/var/tmp/models/tiny.gguf"
    assert made["spec"]["cooperative"]["force_split"] is None
    plan = api.ok("GET", f"{S}/big/plan", headers=red)
    assert plan["service"] == "big" and plan["status"] == "measuring" and plan["attempt"] == 0
    assert plan["shards"] == [] and plan["candidates"] == [] and plan["reason"]
    assert api.ok("GET", f"{S}/big/plan", headers=viewer)["service"] == "big"
    # another tenant's, a missing one and one that is not cooperative: the same 404
    theirs = api.get(f"{S}/big/plan", headers=blue)
    missing = api.get(f"{S}/nothing/plan", headers=blue)
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json()["error"] == "service 'big' not found"
    assert missing.json()["error"] == "service 'nothing' not found"
    assert api.get(f"{S}/big/plan", headers=blue, params={"tenant": "red"}).status_code == 404
    put(api, "plain", {"request": {"command": ["engine"], "cpu_milli": 500}}, headers=red)
    plain = api.get(f"{S}/plain/plan", headers=red)
    assert plain.status_code == 404 and plain.json()["error"] == "service 'plain' not found"
    assert api.get(f"{S}/big/plan", headers={}).status_code == 401
    # the admin picks it by tenant
    assert api.ok("GET", f"{S}/big/plan", params={"tenant": "red"})["service"] == "big"


def test_a_cooperative_spec_is_checked_and_names_the_field(api: Api) -> None:
    quiet(api)
    cases: list[tuple[dict[str, Any], str]] = [
        (coop_spec(max_replicas=2), "cooperative service runs one replica"),
        (coop_spec(cooperative={"model": "relative.gguf"}), "cooperative.model"),
        (coop_spec(cooperative={"model": "/m.gguf", "force_split": 0}), "force_split"),
        (coop_spec(cooperative={"model": "/m.gguf", "min_gain": 0.5}), "min_gain"),
        (coop_spec(cooperative={"model": "/m.gguf", "surprise": 1}), "surprise"),
        ({"request": {"cpu_milli": 1}}, "request.command"),  # not cooperative: a command is needed
    ]
    for body, word in cases:
        r = api.put(f"{S}/x", json={"spec": body}, headers=api.admin)
        assert r.status_code == 422, (body, r.text)
        assert word in r.text, (word, r.text)


def test_no_replica_before_the_coop_controller_wrote_the_head(api: Api) -> None:
    quiet(api)
    join(api, "n1")
    put(api, "big", coop_spec(min_replicas=1, max_replicas=1))
    api.app.state.controller.acquire()
    import asyncio

    rep = asyncio.run(api.app.state.service_controller.run_once())
    assert rep.started == []
    out = api.ok("GET", f"{S}/big")
    assert out["desired"] == 0 and out["replicas"] == []
    assert out["reason"].startswith("cooperative: waiting for the coop controller's plan"), out["reason"]


def test_every_node_carries_its_name_as_a_label(api: Api) -> None:
    manual(api)
    join(api, "n1")
    assert api.ok("GET", "/api/v1/nodes/n1")["labels"]["cpool.io/node"] == "n1"
    # an admin replacing the labels cannot take it away (allocations are pinned with it)
    r = api.put("/api/v1/nodes/n1", json={"labels": {"zone": "a"}, "taints": {}}, headers=api.admin)
    assert r.status_code == 200, r.text
    assert r.json()["labels"] == {"cpool.io/node": "n1", "zone": "a"}
