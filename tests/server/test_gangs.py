"""Gangs at run time on the real app (SQLite and PostgreSQL): node addresses, what each member is told,
member states moving the gang as a whole, and master ports kept apart on one rank-0 node."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness import Api, heartbeat_ago
from test_allocations import alloc, cycle, get, manual
from test_allocations_agent import assignments, report

H = dict[str, str]


def join(api: Api, name: str, address: str | None = None, devices: int = 2) -> H:
    token = api.ok("POST", "/api/v1/join-tokens", json={})["token"]
    body: dict[str, Any] = {
        "join_token": token,
        "name": name,
        "cpu_milli": 8000,
        "memory_mib": 16384,
        "devices": [
            {
                "index": i,
                "vendor": "simulated",
                "model": "A100",
                "memory_mib": 40960,
                "uuid": f"GPU-{name}-{i}",
            }
            for i in range(devices)
        ],
    }
    if address is not None:
        body["address"] = address
    cred = api.ok("POST", "/api/v1/nodes/join", json=body, headers={})["credential"]
    return {"Authorization": f"Bearer {cred}"}


def two_nodes(api: Api) -> dict[str, H]:
    manual(api)
    return {"a": join(api, "a", "10.0.0.1"), "b": join(api, "b", "10.0.0.2")}


def gang_job(api: Api, **body: Any) -> dict[str, Any]:
    job = alloc(api, gpus=1, gang_nodes=2, command=["train"], **body)
    cycle(api)
    job = get(api, job["id"])
    assert job["state"] == "bound", job
    return job


def member_report(
    api: Api, node: str, creds: H, job: dict[str, Any], state: str, **kw: Any
) -> dict[str, Any]:
    body = {"allocation_id": job["id"], "attempt": job["attempt"], "state": state, **kw}
    return report(api, node, creds, body)


def test_each_member_is_told_its_rank_and_the_gang_is_released_when_all_exit_0(api: Api) -> None:
    creds = two_nodes(api)
    job = gang_job(api, env={"EPOCHS": "2"})
    ranks = job["nodes"]
    assert sorted(ranks) == ["a", "b"]
    addr = {"a": "10.0.0.1", "b": "10.0.0.2"}
    assert [(m["rank"], m["node"], m["address"], m["state"]) for m in job["members"]] == [
        (r, n, addr[n], "starting") for r, n in enumerate(ranks)
    ]
    # rank 0 first: the others wait until it runs, with the master port it offers
    assert assignments(api, ranks[1], creds[ranks[1]])["assignments"] == []
    told = {}
    [asg] = assignments(api, ranks[0], creds[ranks[0]])["assignments"]
    assert asg["env"] == {"EPOCHS": "2"}
    told[ranks[0]] = asg["gang"]
    port = told[ranks[0]]["master_port"]
    assert 29500 <= port <= 29999
    member_report(api, ranks[0], creds[ranks[0]], job, "running", master_port=port)
    j = get(api, job["id"])
    assert j["state"] == "active" and f"started on {ranks[0]}" in j["reason"]
    assert [m["state"] for m in j["members"]] == ["running", "starting"]
    [asg] = assignments(api, ranks[1], creds[ranks[1]])["assignments"]
    assert asg["env"] == {"EPOCHS": "2"}
    told[ranks[1]] = asg["gang"]
    for rank, node in enumerate(ranks):
        assert told[node] == {
            "rank": rank,
            "size": 2,
            "master_addr": addr[ranks[0]],
            "master_port": port,
            "peers": [addr[n] for n in ranks],
            "nproc_per_node": 1,
            "master_ports": [29500, 29999] if rank == 0 else None,
        }

    member_report(api, ranks[1], creds[ranks[1]], job, "running")
    out = member_report(api, ranks[0], creds[ranks[0]], job, "exited", exit_code=0)
    assert out["stale"] == []
    j = get(api, job["id"])
    assert j["state"] == "active", "one member's exit 0 must not release the gang"
    assert [(m["state"], m["exit_code"]) for m in j["members"]] == [("exited", 0), ("running", None)]
    assert assignments(api, ranks[1], creds[ranks[1]])["assignments"], "the other member still runs"
    member_report(api, ranks[1], creds[ranks[1]], job, "exited", exit_code=0)
    j = get(api, job["id"])
    assert j["state"] == "released" and j["exit_code"] == 0 and j["reason"] == "exited 0 on all 2 nodes"
    assert [m["state"] for m in j["members"]] == ["exited", "exited"]


def test_a_member_that_exits_non_zero_fails_the_gang_and_the_others_are_stopped(api: Api) -> None:
    creds = two_nodes(api)
    job = gang_job(api)
    r0, r1 = job["nodes"]
    member_report(api, r0, creds[r0], job, "running")
    member_report(api, r1, creds[r1], job, "running")
    member_report(api, r1, creds[r1], job, "exited", exit_code=3)
    j = get(api, job["id"])
    assert j["state"] == "failed" and j["exit_code"] == 3
    assert j["reason"] == f"rank 1 on node {r1} exited 3"
    assert [(m["state"], m["exit_code"]) for m in j["members"]] == [("stopped", None), ("exited", 3)]
    assert j["members"][0]["reason"] == f"stopped: rank 1 on node {r1} exited 3"
    # rank 0 hears it twice over: its assignment is gone, and its next report is answered stale
    assert assignments(api, r0, creds[r0])["assignments"] == []
    out = member_report(api, r0, creds[r0], job, "running")
    assert out["accepted"] == [] and "failed" in out["stale"][0]["reason"]


def test_a_member_that_fails_to_start_names_itself(api: Api) -> None:
    creds = two_nodes(api)
    job = gang_job(api)
    r0, _ = job["nodes"]
    member_report(api, r0, creds[r0], job, "failed", reason="could not start: master port 29500 is in use")
    j = get(api, job["id"])
    assert j["state"] == "failed"
    assert j["reason"] == f"rank 0 on node {r0} failed: could not start: master port 29500 is in use"


def test_rank_0_offers_another_master_port_and_the_others_are_told_it(api: Api) -> None:
    """Another process held the reserved port on rank 0's node: its agent offered another one, and
    the gang goes on with it (the other members, waiting until then, are told that one)."""
    creds = two_nodes(api)
    job = gang_job(api)
    r0, r1 = job["nodes"]
    [asg] = assignments(api, r0, creds[r0])["assignments"]
    reserved = asg["gang"]["master_port"]
    offered = 29500 if reserved != 29500 else 29501
    assert assignments(api, r1, creds[r1])["assignments"] == []
    member_report(api, r0, creds[r0], job, "running", master_port=offered)
    j = get(api, job["id"])
    assert j["state"] == "active" and [m["state"] for m in j["members"]] == ["running", "starting"]
    [asg] = assignments(api, r1, creds[r1])["assignments"]
    assert asg["gang"]["master_port"] == offered and asg["gang"]["rank"] == 1
    assert assignments(api, r0, creds[r0])["assignments"][0]["gang"]["master_port"] == offered
    # once the gang runs, the port is settled: a later report changes nothing
    member_report(api, r0, creds[r0], job, "running", master_port=reserved)
    assert assignments(api, r1, creds[r1])["assignments"][0]["gang"]["master_port"] == offered


def test_a_lost_member_requeues_a_restartable_gang_as_a_whole(api: Api) -> None:
    creds = two_nodes(api)
    job = gang_job(api, restartable=True)
    r0, r1 = job["nodes"]
    member_report(api, r0, creds[r0], job, "running")
    member_report(api, r1, creds[r1], job, "running")
    first_port = assignments(api, r0, creds[r0])["assignments"][0]["gang"]["master_port"]
    member_report(api, r1, creds[r1], job, "lost", reason="no such process")
    j = get(api, job["id"])
    assert j["state"] == "pending" and j["attempt"] == 2 and j["members"] == [] and j["nodes"] == []
    assert f"rank 1 on node {r1}: process lost (no such process)" in j["reason"]
    assert "requeued as attempt 2" in j["reason"]
    assert assignments(api, r0, creds[r0])["assignments"] == []
    assert member_report(api, r0, creds[r0], job, "running")["stale"], "attempt 1 is over everywhere"
    cycle(api)
    j = get(api, job["id"])
    assert j["state"] == "bound" and j["attempt"] == 2
    assert [m["state"] for m in j["members"]] == ["starting", "starting"]
    for rank, node in enumerate(j["nodes"]):
        [asg] = assignments(api, node, creds[node])["assignments"]
        assert asg["attempt"] == 2 and asg["gang"]["rank"] == rank
        assert 29500 <= asg["gang"]["master_port"] <= 29999
        if rank == 0:  # the others wait for it again
            member_report(api, node, creds[node], j, "running")
    del first_port  # a fresh port is chosen; it may by chance be the same one


def test_a_lost_member_fails_a_gang_that_cannot_restart(api: Api) -> None:
    creds = two_nodes(api)
    job = gang_job(api)
    r0, r1 = job["nodes"]
    member_report(api, r0, creds[r0], job, "lost")
    j = get(api, job["id"])
    assert j["state"] == "failed" and j["reason"] == f"rank 0 on node {r0}: process lost"
    assert [m["state"] for m in j["members"]] == ["lost", "stopped"]


def test_master_ports_differ_for_gangs_with_the_same_rank_0(make_api: Callable[..., Api]) -> None:
    api = make_api(gang_port_min=29600, gang_port_max=29601)
    creds = two_nodes(api)
    jobs = [alloc(api, gpus=1, gang_nodes=2, command=["train"]) for _ in range(2)]
    cycle(api)  # one cycle binds both: the reservation for the first ends when it is bound
    got = [get(api, j["id"]) for j in jobs]
    assert all(j["state"] == "bound" for j in got), [(j["state"], j["reason"]) for j in got]
    ports: dict[str, list[int]] = {}
    for j in got:
        rank0 = j["nodes"][0]
        [asg] = [
            x for x in assignments(api, rank0, creds[rank0])["assignments"] if x["allocation_id"] == j["id"]
        ]
        ports.setdefault(rank0, []).append(asg["gang"]["master_port"])
    for held in ports.values():
        assert len(set(held)) == len(held) and set(held) <= {29600, 29601}
    assert max(len(v) for v in ports.values()) == 2, f"the two gangs should share rank 0: {ports}"


def test_cpu_only_gang_and_single_nodes_unchanged(api: Api) -> None:
    creds = two_nodes(api)
    gang = alloc(api, gang_nodes=2, cpu_milli=1000, command=["sh", "-c", "true"])
    single = alloc(api, cpu_milli=1000, command=["true"])
    cycle(api)
    g = get(api, gang["id"])
    assert g["state"] == "bound" and sorted(g["nodes"]) == ["a", "b"] and g["slices"] == []
    member_report(api, g["nodes"][0], creds[g["nodes"][0]], g, "running")
    asg = {
        x["allocation_id"]: x for x in assignments(api, g["nodes"][1], creds[g["nodes"][1]])["assignments"]
    }
    assert asg[gang["id"]]["gang"]["rank"] == 1 and asg[gang["id"]]["gang"]["nproc_per_node"] == 1
    s = get(api, single["id"])
    node = s["nodes"][0]
    [mine] = [x for x in assignments(api, node, creds[node])["assignments"] if x["allocation_id"] == s["id"]]
    assert mine["gang"] is None and s["members"] == []
    report(
        api, node, creds[node], {"allocation_id": s["id"], "attempt": 1, "state": "exited", "exit_code": 0}
    )
    assert get(api, s["id"])["reason"] == "exited 0"


def test_node_address_given_seen_and_updated(api: Api) -> None:
    creds = {"a": join(api, "a", "Node-A.example.org."), "b": join(api, "b")}
    nodes = {n["name"]: n for n in api.ok("GET", "/api/v1/nodes")["items"]}
    assert nodes["a"]["address"] == "node-a.example.org"
    assert nodes["b"]["address"] == "testclient"  # where the join came from, as the server saw it
    hb = "/api/v1/nodes/a/heartbeat"
    said = api.post(hb, json={"address": "[fd00::1]"}, headers=creds["a"])
    assert said.status_code == 200 and said.json()["address"] == "fd00::1"  # the agent learns it
    assert api.ok("GET", "/api/v1/nodes/a")["address"] == "fd00::1"
    said = api.post(hb, json={}, headers=creds["a"])  # absent: unchanged
    assert said.status_code == 200 and said.json().get("address") is None
    assert api.ok("GET", "/api/v1/nodes/a")["address"] == "fd00::1"
    assert api.post(hb, json={"address": ""}, headers=creds["a"]).status_code == 200  # "": as seen
    assert api.ok("GET", "/api/v1/nodes/a")["address"] == "testclient"
    for bad in ("bad host!", "10.0.0.300", "-x.example"):
        r = api.post(hb, json={"address": bad}, headers=creds["a"])
        assert r.status_code == 422 and "address" in r.text, (bad, r.text)
    token = api.ok("POST", "/api/v1/join-tokens", json={})["token"]
    body = {"join_token": token, "name": "c", "cpu_milli": 1000, "memory_mib": 1024, "address": "a b"}
    r = api.post("/api/v1/nodes/join", json=body)
    assert r.status_code == 422 and "address" in r.text


def test_a_lost_node_fails_or_requeues_the_whole_gang_naming_its_rank(make_api: Callable[..., Api]) -> None:
    # a long interval: nodes stay fresh (placeable) however late the cycle runs on a busy host
    api = make_api(heartbeat_interval_s=10, suspect_after_s=50, lost_after_s=100)
    creds = two_nodes(api)
    once = alloc(api, gpus=1, gang_nodes=2, command=["train"])
    again = alloc(api, gpus=1, gang_nodes=2, command=["train"], restartable=True)
    for node in creds:
        api.ok("POST", f"/api/v1/nodes/{node}/heartbeat", headers=creds[node])
    cycle(api)
    ranks = {j["id"]: get(api, j["id"])["nodes"] for j in (once, again)}
    assert all(sorted(r) == ["a", "b"] for r in ranks.values()), ranks
    api.ok("POST", "/api/v1/nodes/a/heartbeat", headers=creds["a"])
    heartbeat_ago(api, "b", 120)  # b said nothing more
    cycle(api)
    o = get(api, once["id"])
    assert (
        o["state"] == "failed"
        and o["reason"] == f"node b (rank {ranks[once['id']].index('b')} of the gang) lost"
    )
    assert [m["state"] for m in o["members"]] == ["stopped", "stopped"]
    r = get(api, again["id"])
    assert r["state"] == "pending" and r["attempt"] == 2 and r["members"] == []
    assert assignments(api, "a", creds["a"])["assignments"] == []  # a's members are stopped
