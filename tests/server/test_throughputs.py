"""Measured speeds: heartbeats' progress folded into per-tenant rows (an exponentially weighted
mean), who sees which rows, bad input, and the scheduler placing a job type on its fastest model."""

from __future__ import annotations

from typing import Any

import pytest
from harness import Api, H
from test_allocations import alloc, cycle, get, join, manual
from test_allocations_agent import report

T = "/api/v1/throughputs"


def beat(api: Api, node: str, headers: H, *progress: dict[str, Any]) -> Any:
    return api.post(f"/api/v1/nodes/{node}/heartbeat", headers=headers, json={"progress": list(progress)})


def step(a: dict[str, Any], rate: float, attempt: int = 1) -> dict[str, Any]:
    return {"allocation_id": a["id"], "attempt": attempt, "steps_per_s": rate}


def rows(api: Api, headers: H, **params: Any) -> list[dict[str, Any]]:
    return list(api.ok("GET", T, headers=headers, params=params)["items"])


def test_progress_makes_per_tenant_rows_each_tenant_sees_its_own(api: Api) -> None:
    manual(api)
    n1 = join(api, "n1", devices=3, model="V100-SXM2-16GB")
    api.tenant("acme")
    api.tenant("beta")
    alice = api.user("alice", "acme", "member")
    bob = api.user("bob", "beta", "member")
    ja = alloc(api, alice, gpus=1, command=["train"], job_type="resnet50")
    jb = alloc(api, bob, gpus=1, command=["train"], job_type="resnet50")
    plain = alloc(api, alice, gpus=1, command=["train"])  # no job type: counts nowhere
    assert ja["request"]["job_type"] == "resnet50" and plain["request"]["job_type"] is None
    cycle(api)
    for j in (ja, jb, plain):
        report(api, "n1", n1, {"allocation_id": j["id"], "attempt": 1, "state": "running"})
    assert beat(api, "n1", n1, step(ja, 10.0), step(jb, 50.0), step(plain, 7.0)).status_code == 200
    # ignored: another attempt, an allocation that is not here
    assert (
        beat(api, "n1", n1, step(ja, 20.0), step(ja, 99.0, attempt=2), step({"id": 9999}, 5.0)).status_code
        == 200
    )

    mine = rows(api, alice)
    assert [(r["tenant"], r["job_type"], r["model"], r["devices"], r["samples"]) for r in mine] == [
        ("acme", "resnet50", "V100-SXM2-16GB", 1, 2)
    ]
    assert mine[0]["steps_per_s"] == pytest.approx(10.0 + 0.3 * (20.0 - 10.0))  # the weighted mean
    theirs = rows(api, bob)
    assert [(r["tenant"], r["steps_per_s"], r["samples"]) for r in theirs] == [("beta", 50.0, 1)]
    assert [r["tenant"] for r in rows(api, api.admin)] == ["acme", "beta"]  # an admin sees all
    assert rows(api, alice, job_type="bert") == []
    assert get(api, ja["id"], alice)["request"]["job_type"] == "resnet50"


def test_bad_input_is_refused_naming_the_field(api: Api) -> None:
    manual(api)
    n1 = join(api, "n1", devices=1)
    for bad in (-1.0, 0.0, 1e10):
        r = beat(api, "n1", n1, {"allocation_id": 1, "attempt": 1, "steps_per_s": bad})
        assert r.status_code == 422 and "steps_per_s" in r.text, r.text
    r = beat(api, "n1", n1, {"allocation_id": 1, "attempt": 0, "steps_per_s": 1.0})
    assert r.status_code == 422 and "attempt" in r.text
    r = api.post("/api/v1/allocations", headers=api.admin, json={"gpus": 1, "job_type": "Res Net"})
    assert r.status_code == 422 and "job_type" in r.text
    r = api.get(T, headers=api.admin, params={"job_type": "Res Net"})
    assert r.status_code == 422 and "job_type" in r.text
    assert api.get(T).status_code == 401


def test_a_measured_job_type_goes_to_its_fastest_model(api: Api) -> None:
    manual(api)
    slow = join(api, "n1", devices=2, model="V100-SXM2-16GB")  # the first node: untyped work goes here
    fast = join(api, "n2", devices=2, model="A100-SXM4-40GB")
    api.tenant("acme")
    alice = api.user("alice", "acme", "member")
    train = alloc(api, alice, gpus=2, command=["train"], job_type="resnet50")
    again = alloc(api, alice, gpus=2, command=["train"], job_type="resnet50")
    cycle(api)
    on = {get(api, j["id"])["nodes"][0]: j for j in (train, again)}
    assert set(on) == {"n1", "n2"}
    for node, headers, rate in (("n1", slow, 10.0), ("n2", fast, 30.0)):
        report(api, node, headers, {"allocation_id": on[node]["id"], "attempt": 1, "state": "running"})
        assert beat(api, node, headers, step(on[node], rate)).status_code == 200
        report(
            api,
            node,
            headers,
            {"allocation_id": on[node]["id"], "attempt": 1, "state": "exited", "exit_code": 0},
        )
    assert {(r["model"], r["devices"]) for r in rows(api, alice)} == {
        ("V100-SXM2-16GB", 2),
        ("A100-SXM4-40GB", 2),
    }
    typed = alloc(api, alice, gpus=1, command=["train"], job_type="resnet50")
    untyped = alloc(api, alice, gpus=1, command=["train"])
    more = [alloc(api, alice, gpus=1, command=["train"], job_type="resnet50") for _ in range(2)]
    cycle(api)
    placed = [get(api, j["id"])["nodes"] for j in (typed, untyped, *more)]
    # the typed one on the fast model; the untyped one where it always went; the fast one full: slow
    assert placed == [["n2"], ["n1"], ["n2"], ["n1"]]
