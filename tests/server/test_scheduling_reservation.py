"""The control plane's gang placement: reservation with backfill, a topology label and `colocate`,
NVLink groups — through the API and the real controller, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable

from harness import Api, H
from test_allocations import alloc, cycle, explain, get, manual


def join(
    api: Api, name: str, devices: int, labels: dict[str, str] | None = None, links: list[str] | None = None
) -> H:
    token = api.ok("POST", "/api/v1/join-tokens", json={})["token"]
    body = {
        "join_token": token,
        "name": name,
        "cpu_milli": 16000,
        "memory_mib": 65536,
        "labels": labels or {},
        "devices": [
            {
                "index": i,
                "vendor": "simulated",
                "model": "A100",
                "memory_mib": 40960,
                "uuid": f"GPU-{name}-{i}",
                "link_group": (links or [""] * devices)[i],
            }
            for i in range(devices)
        ],
    }
    cred = api.ok("POST", "/api/v1/nodes/join", json=body, headers={})["credential"]
    return {"Authorization": f"Bearer {cred}"}


def test_reservation_holds_nodes_for_the_gang_and_backfills_short_work(api: Api) -> None:
    manual(api)
    join(api, "n1", 2)
    join(api, "n2", 2)
    running = alloc(api, gpus=1, time_limit="10m")
    cycle(api)
    assert get(api, running["id"])["state"] == "bound"
    gang = alloc(api, gpus=2, gang_nodes=2)
    no_limit = alloc(api, gpus=1)
    long_limit = alloc(api, gpus=1, time_limit="1h")
    short = alloc(api, gpus=1, time_limit="2m")
    cycle(api)
    assert get(api, short["id"])["state"] == "bound"  # ends before the gang could start: backfilled
    for held in (no_limit, long_limit):
        a = get(api, held["id"])
        assert a["state"] == "pending"
        assert a["reason"].startswith(f"waits: capacity reserved for gang {gang['id']} from ~"), a["reason"]
        assert "a --time-limit under 9m could start now" in a["reason"], a["reason"]
        assert explain(api, held["id"])["summary"] == a["reason"]
    g = get(api, gang["id"])
    assert g["state"] == "pending" and "reserved: nodes n1, n2 from ~" in g["reason"], g["reason"]
    assert "reserved: nodes" in explain(api, gang["id"])["summary"]
    # the running work ends: the gang starts first, the held-back work after it
    api.ok("POST", f"/api/v1/allocations/{running['id']}/release")
    api.ok("POST", f"/api/v1/allocations/{short['id']}/release")
    cycle(api)
    g = get(api, gang["id"])
    assert g["state"] == "bound" and sorted(g["nodes"]) == ["n1", "n2"]
    assert get(api, no_limit["id"])["state"] == "pending"


def test_work_without_time_limits_still_drains_towards_the_gang(api: Api) -> None:
    manual(api)
    join(api, "n1", 2)
    join(api, "n2", 2)
    alloc(api, gpus=1)  # no time limit: the gang's start time is unknown
    cycle(api)
    gang = alloc(api, gpus=2, gang_nodes=2)
    later = alloc(api, gpus=1, time_limit="1m")
    cycle(api)
    a = get(api, later["id"])
    assert a["state"] == "pending" and "as its nodes free up" in a["reason"], a["reason"]
    assert "time-limit under" not in a["reason"]
    assert "reserved: nodes" in get(api, gang["id"])["reason"]


def test_topology_label_and_colocate(make_api: Callable[..., Api]) -> None:
    api = make_api(topology_label="rack")
    manual(api)
    for name, rack in (("a0", "a"), ("a1", "a"), ("b0", "b"), ("b1", "b"), ("b2", "b")):
        join(api, name, 2, labels={"rack": rack})
    together = alloc(api, gpus=2, gang_nodes=4, colocate="rack")
    cycle(api)
    t = get(api, together["id"])
    assert t["state"] == "pending" and t["request"]["colocate"] == "rack"
    why = "topology: no 4 nodes with room share one value of rack (best: rack=b has 3)"
    assert why in t["reason"] and why in explain(api, together["id"])["summary"]
    api.ok("POST", f"/api/v1/allocations/{together['id']}/cancel")
    three = alloc(api, gpus=2, gang_nodes=3)  # preferred, not required: the tightest rack holding it
    cycle(api)
    assert sorted(get(api, three["id"])["nodes"]) == ["b0", "b1", "b2"]
    two = alloc(api, gpus=2, gang_nodes=2, colocate="rack")
    cycle(api)
    assert sorted(get(api, two["id"])["nodes"]) == ["a0", "a1"]
    r = api.post(
        "/api/v1/allocations",
        json={"gpus": 1, "gang_nodes": 2, "colocate": "no such key!"},
        headers=api.admin,
    )
    assert r.status_code == 422 and "colocate" in r.text


def test_multi_gpu_allocation_takes_one_nvlink_group(api: Api) -> None:
    manual(api)
    join(api, "n1", 4, links=["nv0", "nv0", "nv1", "nv1"])
    one = alloc(api, gpus=1)
    cycle(api)
    first = get(api, one["id"])["slices"][0]["device_index"]
    pair = alloc(api, gpus=2)
    cycle(api)
    got = sorted(s["device_index"] for s in get(api, pair["id"])["slices"])
    assert got == ([2, 3] if first in (0, 1) else [0, 1])
