"""Static capacity: node labels and selectors, taints and tolerations, nodes dedicated to a tenant.

Against the real app (SQLite and PostgreSQL), with cycles run by the test so the order is fixed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from harness import Api
from hypothesis import given, settings
from hypothesis import strategies as st
from test_allocations import alloc, cycle, explain, get, join, manual

from computepool.core import Device, Node, Request
from computepool.scheduler.constraints import NodeConstraints, NodeRules
from computepool.scheduler.placement import Scheduler
from computepool.scheduler.policies import make_scorer
from computepool.scheduler.queueing import Claim, Holding, select_victims
from computepool.scheduler.state import ClusterState

N = "/api/v1/nodes"
A = "/api/v1/allocations"


def patch(api: Api, node: str, expect: int = 200, headers: Any = None, **body: Any) -> dict[str, Any]:
    r = api.patch(f"{N}/{node}", json=body, headers=headers or api.admin)
    assert r.status_code == expect, r.text
    return dict(r.json())


def test_labels_steer_selectors_and_admins_change_them(api: Api) -> None:
    manual(api)
    join(api, "n1")
    join(api, "n2")
    out = patch(api, "n2", labels={"gpu-class": "a100", "zone": "b"})
    assert out["labels"] == {"gpu-class": "a100", "zone": "b", "cpool.io/node": "n2"}
    a = alloc(api, gpus=1, node_selector={"gpu-class": "a100"})
    cycle(api)
    assert get(api, a["id"])["nodes"] == ["n2"]
    # n2 is now full: the next one waits, though n1 is idle, and says why
    b = alloc(api, gpus=1, node_selector={"gpu-class": "a100"})
    cycle(api)
    assert get(api, b["id"])["state"] == "pending"
    ex = explain(api, b["id"])
    counts = ex["reasons"]["counts"]
    assert counts.pop("node selector") == 1 and list(counts.values()) == [1], ex  # n1; n2 is full
    # a label set on n1 lets it in; removing a label with null takes it out again
    patch(api, "n1", labels={"gpu-class": "a100"})
    cycle(api)
    assert get(api, b["id"])["nodes"] == ["n1"]
    assert patch(api, "n2", labels={"zone": None})["labels"] == {"gpu-class": "a100", "cpool.io/node": "n2"}
    # PUT replaces the rules whole
    r = api.put(f"{N}/n2", json={"labels": {"x": "1"}}, headers=api.admin)
    assert r.status_code == 200 and r.json()["labels"] == {"x": "1", "cpool.io/node": "n2"}
    assert r.json()["taints"] == {}


def test_selector_no_node_matches_is_accepted_and_explained(api: Api) -> None:
    manual(api)
    join(api, "n1")
    a = alloc(api, gpus=1, node_selector={"gpu-class": "h100"})  # not refused: nodes may join later
    cycle(api)
    ex = explain(api, a["id"])
    assert ex["state"] == "pending" and ex["reasons"]["counts"] == {"node selector": 1}
    assert any("gpu-class=h100 matches no node" in n for n in ex["reasons"]["notes"]), ex
    assert "node selector" in ex["summary"]


def test_taints_keep_general_work_off(api: Api) -> None:
    manual(api)
    join(api, "n1")
    out = patch(api, "n1", taints={"reserved": "db"})
    assert out["taints"] == {"reserved": "db"}
    general = alloc(api, gpus=1)
    wrong = alloc(api, gpus=1, tolerations=["reserved=web"])
    cycle(api)
    for x in (general, wrong):
        assert get(api, x["id"])["state"] == "pending"
        ex = explain(api, x["id"])
        assert ex["reasons"]["counts"] == {"untolerated taint": 1}
        assert ex["reasons"]["notes"] == [
            "untolerated taints reserved=db: only work with a matching toleration goes there"
        ]
    exact = alloc(api, gpus=1, tolerations=["reserved=db"])
    cycle(api)
    assert get(api, exact["id"])["nodes"] == ["n1"]
    assert get(api, exact["id"])["request"]["tolerations"] == ["reserved=db"]
    api.ok("POST", f"{A}/{exact['id']}/release")
    any_value = alloc(api, gpus=1, tolerations=["reserved"])  # a bare key tolerates every value
    cycle(api)
    assert get(api, any_value["id"])["nodes"] == ["n1"]
    api.ok("POST", f"{A}/{any_value['id']}/release")
    patch(api, "n1", taints={"reserved": None})
    cycle(api)
    assert get(api, general["id"])["state"] == "bound"  # the taint gone, general work goes there


def test_dedicated_node_owner_first_borrowers_preempted(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=1)
    join(api, "n2", devices=1)
    for t in ("ml", "web"):
        api.tenant(t)
    ml = api.user("mia", "ml", "member")
    web = api.user("wes", "web", "member")
    out = patch(api, "n1", dedicated_to="ml")
    assert out["dedicated"] and out["dedicated_to"] == "ml" and out["lending"]
    # others see that it is dedicated, not to whom
    seen = api.ok("GET", f"{N}/n1", headers=web)
    assert seen["dedicated"] and seen["dedicated_to"] is None
    assert api.ok("GET", f"{N}/n1", headers=ml)["dedicated_to"] == "ml"
    # a borrower goes to the shared node first, then borrows the dedicated one
    w1 = alloc(api, web, gpus=1, restartable=True, command=["true"])
    cycle(api)
    assert get(api, w1["id"], web)["nodes"] == ["n2"]
    w2 = alloc(api, web, gpus=1, restartable=True, command=["true"])
    cycle(api)
    borrowed = get(api, w2["id"], web)
    assert borrowed["nodes"] == ["n1"] and "dedicated to another tenant: preemptible" in borrowed["reason"]
    assert "(" not in get(api, w1["id"], web)["reason"]  # on the shared node: nothing to say
    # the owner's work takes its node back (no quota needed); the restartable borrower requeues
    m = alloc(api, ml, gpus=1)
    cycle(api)
    assert get(api, m["id"], ml)["nodes"] == ["n1"]
    back = get(api, w2["id"], web)
    assert back["state"] == "pending" and back["attempt"] == 2, back
    assert "dedicated node taken back by its tenant ml" in back["events"][2]["reason"]
    assert get(api, w1["id"], web)["state"] == "bound"  # work on the shared node stays


def test_no_lending_keeps_others_off_and_says_so(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=1)
    for t in ("ml", "web"):
        api.tenant(t)
    ml = api.user("mia", "ml", "member")
    web = api.user("wes", "web", "member")
    out = patch(api, "n1", dedicated_to="ml", lending=False)
    assert out["lending"] is False
    w = alloc(api, web, gpus=1)
    cycle(api)
    assert get(api, w["id"], web)["state"] == "pending"
    ex = explain(api, w["id"], web)
    assert ex["reasons"]["counts"] == {"dedicated to another tenant": 1}, ex
    assert ex["reasons"]["notes"] == ["1 node dedicated to another tenant, not lent to others"]
    m = alloc(api, ml, gpus=1)
    cycle(api)
    assert get(api, m["id"], ml)["nodes"] == ["n1"]
    api.ok("POST", f"{A}/{m['id']}/release", headers=ml)
    # undedicated (null): everyone may use it again
    out = patch(api, "n1", dedicated_to=None, lending=True)
    assert not out["dedicated"] and out["dedicated_to"] is None
    cycle(api)
    assert get(api, w["id"], web)["nodes"] == ["n1"]


def test_rules_are_audited_admin_only_and_checked(api: Api) -> None:
    manual(api)
    join(api, "n1")
    api.tenant("ml")
    member = api.user("mia", "ml", "member")
    patch(api, "n1", expect=403, headers=member, labels={"a": "b"})
    r = patch(api, "n1", expect=422, dedicated_to="nobody")
    assert r["field"] == "dedicated_to" and "nobody" in r["error"]
    assert patch(api, "n1", expect=422, labels={"bad key!": "x"})["field"].startswith("labels")
    assert patch(api, "n1", expect=422, lending="yes")["field"] == "lending"
    assert patch(api, "n1", expect=422, colour="red")["field"] == "colour"
    patch(api, "nope", expect=404, labels={"a": "b"})
    bad = api.post(A, json={"gpus": 1, "tolerations": ["=x"]}, headers=api.admin)
    assert bad.status_code == 422 and bad.json()["field"].startswith("tolerations"), bad.text
    patch(api, "n1", labels={"a": "b"}, taints={"t": "1"}, dedicated_to="ml", lending=False)
    audit = api.ok("GET", "/api/v1/audit", params={"action": "node.update"})["items"]
    assert [e["outcome"] for e in audit].count("refused:403") == 1  # the member's attempt
    done = [e for e in audit if e["outcome"] == "ok"]
    assert (
        len(done) == 1
        and done[0]["target"] == "node:n1"
        and done[0]["detail"]
        == {
            "labels": {"a": "b", "cpool.io/node": "n1"},
            "taints": {"t": "1"},
            "dedicated_to": "ml",
            "lending": False,
        }
    )
    # nothing already stored was lost by the refused calls
    assert api.ok("GET", f"{N}/n1")["labels"]["a"] == "b"


# --- the scheduler alone: the rules hold over random pools and request streams -------------------
def _pool(rules: list[NodeRules]) -> ClusterState:
    nodes = [
        Node(
            name=f"n{i}",
            cpu_milli=64000,
            memory_mib=65536,
            devices=[Device(j, "", "A100", 40960, f"u{i}-{j}", 1000) for j in range(2)],
            schedulable=True,
        )
        for i in range(len(rules))
    ]
    state = ClusterState.from_nodes(nodes)
    state.rules = NodeConstraints(rules)
    return state


_rules = st.builds(
    NodeRules,
    labels=st.dictionaries(st.sampled_from(["gpu", "zone"]), st.sampled_from(["a", "b"]), max_size=2),
    taints=st.dictionaries(st.sampled_from(["team", "db"]), st.sampled_from(["x", "y"]), max_size=1),
    dedicated_to=st.sampled_from([None, None, "t1", "t2"]),
    lending=st.booleans(),
)
_requests = st.builds(
    Request,
    gpu_count=st.just(1),
    gpu_milli=st.sampled_from([250, 500, 1000]),
    tenant=st.sampled_from(["t1", "t2", "t3"]),
    node_selector=st.lists(
        st.tuples(st.sampled_from(["gpu", "zone"]), st.sampled_from(["a", "b"])), max_size=1
    ).map(tuple),
    tolerations=st.frozensets(st.sampled_from(["team", "team=x", "db=y"]), max_size=2),
)


@settings(max_examples=60, deadline=None)
@given(rules=st.lists(_rules, min_size=1, max_size=6), reqs=st.lists(_requests, max_size=12))
def test_placements_respect_node_rules(rules: list[NodeRules], reqs: list[Request]) -> None:
    state = _pool(rules)
    sched = Scheduler(make_scorer("default"))
    for req in reqs:
        d = sched.schedule(state, req)
        for pl in d.placements:
            r = rules[pl.node]
            assert all(r.labels.get(k) == v for k, v in req.node_selector)
            assert all(k in req.tolerations or f"{k}={v}" in req.tolerations for k, v in r.taints.items())
            assert r.dedicated_to in (None, req.tenant) or r.lending
        if not d.ok:  # the reason counts every node once, rules included
            assert d.reasons is not None and sum(d.reasons.counts.values()) == len(rules)
    state.check_invariants()


def test_preference_puts_owners_on_their_nodes_and_borrowers_elsewhere() -> None:
    rules = [NodeRules(dedicated_to="t1"), NodeRules(), NodeRules(dedicated_to="t2", lending=False)]
    c = NodeConstraints(rules)
    own, rest = c.preference(Request(gpu_count=1, gpu_milli=1000, tenant="t1"))
    assert own is not None and own.tolist() == [True, False, False] and rest is None
    away, _ = c.preference(Request(gpu_count=1, gpu_milli=1000, tenant="t3"))
    assert away is not None and away.tolist() == [False, True, False]
    assert c.allowed(Request(tenant="t3")).tolist() == [True, True, False]
    assert c.borrowed(Request(tenant="t1")).tolist() == [False, False, True]


@pytest.mark.parametrize("selector", [(("gpu", "a"),), ()])
def test_without_rules_a_selector_matches_nothing(selector: tuple[tuple[str, str], ...]) -> None:
    state = _pool([NodeRules()])
    state.rules = None
    ok = state.eligible(Request(node_selector=selector))
    assert ok.tolist() == ([False] if selector else [True]) and isinstance(ok, np.ndarray)


def test_sim_victims_include_work_on_the_claimants_dedicated_node() -> None:
    # node 0 is dedicated to "ml"; "web" borrows it within web's guarantee (no quota budget to take)
    on_loan = Holding(job=1, tenant="web", placement=((0, 1),), started_at=0.0)
    elsewhere = Holding(job=2, tenant="web", placement=((1, 1),), started_at=5.0)
    claim = Claim(tenant="ml", gpus_per_node=1)
    assert select_victims(claim, [0, 0], [on_loan, elsewhere], {"web": 0}, now=10.0) is None
    got = select_victims(claim, [0, 0], [on_loan, elsewhere], {"web": 0}, now=10.0, lent={1: "ml"})
    assert got is not None and got.victims == (on_loan,) and got.nodes == (0,)
    # another tenant's claim gets nothing from the loan
    assert select_victims(Claim("ops", 1), [0, 0], [on_loan], {"web": 0}, 10.0, lent={1: "ml"}) is None
