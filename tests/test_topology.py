"""Topology-aware placement: devices of one NVLink group inside a node, and a gang's nodes sharing
one value of a node label (preferred with the pool's topology label, required with `colocate`).

The oracles are written from the rules in docs/scheduler.md, not from the code: the fewest NVLink
groups that can hold k of the usable devices is the smallest m whose m largest groups hold k.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from computepool.core import Device, Node, Request
from computepool.scheduler.constraints import NodeConstraints, NodeRules
from computepool.scheduler.placement import Scheduler
from computepool.scheduler.policies import make_scorer
from computepool.scheduler.state import Change, ClusterState, tag_of, tier_code
from computepool.scheduler.topology import why_spread

POLICIES = ["default", "bestfit", "firstfit", "packing", "random", "clustering"]


def gpu_node(name: str, groups: list[str], cpu: int = 64000) -> Node:
    devs = [Device(j, "nvidia", "A100", 81920, f"GPU-{name}-{j}", link_group=g) for j, g in enumerate(groups)]
    return Node(name, cpu, 1 << 20, devs)


def whole(k: int, **kw: object) -> Request:
    return Request(gpu_count=k, gpu_milli=1000, **kw)  # type: ignore[arg-type]


def take(sched: Scheduler, state: ClusterState, req: Request) -> list[int]:
    d = sched.place(state, req)
    assert d.ok, d.reasons
    Scheduler.commit(state, d)
    return d.placements[0].devices


# --- inside a node: NVLink groups -----------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_multi_gpu_request_takes_one_nvlink_group(policy: str) -> None:
    state = ClusterState.from_nodes([gpu_node("n0", ["a"] * 4 + ["b"] * 4)])
    sched = Scheduler(make_scorer(policy))
    take(sched, state, whole(1))  # one device of some group taken
    four = take(sched, state, whole(4))
    links = {state.links[state.gpu_link[0, j]] for j in four}
    assert len(links) == 1, (policy, four)  # the untouched group, not 3 + 1
    rest = take(sched, state, whole(3))
    assert len({state.links[state.gpu_link[0, j]] for j in rest}) == 1


def test_smallest_group_that_holds_it_and_fewest_groups_otherwise() -> None:
    state = ClusterState.from_nodes([gpu_node("n0", ["a", "a", "a", "b", "b", "b", "b", "c"])])
    sched = Scheduler(make_scorer("default"))
    two = take(sched, state, whole(2))
    assert set(two) <= {0, 1, 2}  # group a (3) holds 2 and keeps b (4) whole
    four = take(sched, state, whole(4))
    assert set(four) == {3, 4, 5, 6}
    two_more = take(sched, state, whole(2))  # left: a 1, c 1 — two groups, unavoidable
    assert set(two_more) == {2, 7}


def test_nodes_without_link_groups_place_as_before() -> None:
    nodes = [Node("n0", 64000, 1 << 20, [Device(j, "nvidia", "A100", 81920) for j in range(8)])]
    state = ClusterState.from_nodes(nodes)
    assert state.gpu_link is None
    assert take(Scheduler(make_scorer("bestfit")), state, whole(4)) == [0, 1, 2, 3]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=st.lists(st.sampled_from(["", "a", "b", "c", "d"]), min_size=2, max_size=8),
    busy=st.sets(st.integers(0, 7)),
    k=st.integers(2, 8),
    policy=st.sampled_from(POLICIES),
)
def test_fewest_groups_property(groups: list[str], busy: set[int], k: int, policy: str) -> None:
    state = ClusterState.from_nodes([gpu_node("n0", groups)])
    sched = Scheduler(make_scorer(policy))
    for j in sorted(busy):
        if j < len(groups):
            state.apply(Change(0, 0, 0, {j: 1000}, {j: 81920}, tag_of(1, False), tier_code(whole(1))))
    free = [j for j in range(len(groups)) if j not in busy]
    d = sched.place(state, whole(k))
    assert d.ok == (len(free) >= k)
    if not d.ok:
        return
    got = d.placements[0].devices
    assert set(got) <= set(free) and len(got) == k

    def group(j: int) -> str:
        return groups[j] or f"alone-{j}"

    sizes = sorted((sum(1 for j in free if group(j) == g) for g in {group(j) for j in free}), reverse=True)
    fewest = next(m for m in range(1, len(sizes) + 1) if sum(sizes[:m]) >= k)
    assert len({group(j) for j in got}) == fewest


# --- across nodes: a topology label -------------------------------------------------------------


def racked(racks: dict[str, int], label: str | None = "rack") -> ClusterState:
    nodes, rules = [], []
    for rack, n in racks.items():
        for i in range(n):
            nodes.append(gpu_node(f"{rack}{i}", ["nvl"] * 8))
            rules.append(NodeRules(labels={"rack": rack, "zone": "z1"}))
    state = ClusterState.from_nodes(nodes)
    state.rules = NodeConstraints(rules)
    state.topology_label = label
    return state


def racks_of(state: ClusterState, nodes: list[int]) -> list[str]:
    return [state.names[i].rstrip("0123456789") for i in nodes]


@pytest.mark.parametrize("policy", ["default", "bestfit", "random"])
def test_gang_prefers_the_tightest_rack_that_holds_it(policy: str) -> None:
    state = racked({"a": 3, "b": 4, "c": 5})
    d = Scheduler(make_scorer(policy)).place(state, whole(8, gang_nodes=4))
    assert d.ok and set(racks_of(state, [p.node for p in d.placements])) == {"b"}


def test_gang_spreads_over_the_fewest_racks_when_none_holds_it() -> None:
    state = racked({"a": 3, "b": 4, "c": 5})
    d = Scheduler(make_scorer("default")).place(state, whole(8, gang_nodes=7))
    assert d.ok and set(racks_of(state, [p.node for p in d.placements])) == {"b", "c"}
    # without a topology label the scorer alone decides; the same gang may span all three racks
    plain = Scheduler(make_scorer("default")).place(
        racked({"a": 3, "b": 4, "c": 5}, None), whole(8, gang_nodes=7)
    )
    assert plain.ok


def test_colocate_requires_one_rack_and_explains_when_it_waits() -> None:
    state = racked({"a": 3, "b": 4, "c": 5}, label=None)
    sched = Scheduler(make_scorer("default"))
    d = sched.place(state, whole(8, gang_nodes=6, colocate="rack"))
    assert not d.ok
    text = str(d.reasons)
    assert "topology: no 6 nodes with room share one value of rack (best: rack=c has 5)" in text
    assert why_spread(sched, state, whole(8, gang_nodes=6, colocate="rack")) is not None
    ok = sched.place(state, whole(8, gang_nodes=5, colocate="rack"))
    assert ok.ok and set(racks_of(state, [p.node for p in ok.placements])) == {"c"}
    # a label every node shares holds any gang that fits at all
    assert sched.place(state, whole(8, gang_nodes=12, colocate="zone")).ok
    # a label no node carries: waits, and says so
    none = sched.place(state, whole(8, gang_nodes=2, colocate="switch"))
    assert not none.ok and "no node with room has the label switch" in str(none.reasons)


def test_gang_that_waits_for_capacity_is_not_blamed_on_topology() -> None:
    state = racked({"a": 2, "b": 2}, label=None)
    sched = Scheduler(make_scorer("default"))
    assert why_spread(sched, state, whole(8, gang_nodes=5, colocate="rack")) is None  # 4 nodes in all


def test_gang_rank_order_is_deterministic_and_members_distinct() -> None:
    orders = []
    for _ in range(3):
        state = racked({"a": 3, "b": 4, "c": 5})
        sched = Scheduler(make_scorer("default"))
        take(sched, state, whole(2))  # some load, so the nodes differ
        d = sched.place(state, whole(4, gang_nodes=3))
        assert d.ok
        orders.append([p.node_name for p in d.placements])
    assert orders[0] == orders[1] == orders[2] and len(set(orders[0])) == 3


def test_state_is_unchanged_by_topology_placement() -> None:
    state = racked({"a": 3, "b": 4})
    before = (state.gpu_free.copy(), state.cpu_free.copy(), state.class_of.copy())
    Scheduler(make_scorer("default")).place(state, whole(8, gang_nodes=6, colocate="rack"))
    Scheduler(make_scorer("default")).place(state, whole(8, gang_nodes=5))
    assert all(
        np.array_equal(a, b)
        for a, b in zip(before, (state.gpu_free, state.cpu_free, state.class_of), strict=True)
    )


def test_colocate_is_a_request_option_everywhere() -> None:
    from computepool.cli.alloc_cmd import request_from_options
    from computepool.client.options import build_request
    from computepool.core.errors import InvalidInput

    assert build_request(gpus=8, nodes=4, colocate="rack").body()["colocate"] == "rack"
    body = request_from_options("8", None, "0", "0", False, None, None, nodes=4, colocate="rack").body()
    assert body["colocate"] == "rack" and body["gang_nodes"] == 4
    assert "colocate" not in build_request(gpus=1).body()
    with pytest.raises(InvalidInput, match="colocate"):
        Request(gpu_count=1, gpu_milli=1000, colocate="")
