"""Topology-aware placement: devices of one NVLink group inside a node, and a gang's nodes sharing
one value of a node label (preferred with the pool's topology label, required with `colocate`).

The oracles are written from the rules in docs/scheduler.md, not from the code: the fewest NVLink
groups that can hold k of the usable devices is the smallest m whose m largest groups hold k.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from computepool.core import Device, Node, Request
from computepool.scheduler.constraints import NodeConstraints, NodeRules
from computepool.scheduler.filters import device_need, feasible
from computepool.scheduler.placement import Scheduler, _take_need
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


# --- which node: NVLink fit ------------------------------------------------------------------------

ALL_POLICIES = [*POLICIES, "dotprod"]


def busy(state: ClusterState, node: int, devices: list[int], milli: int = 1000) -> None:
    """Take `milli` of each listed device (whole: exclusive; part: timeslice)."""
    req = whole(1) if milli == 1000 else Request(gpu_count=1, gpu_milli=milli, sharing="shared")  # type: ignore[arg-type]
    for j in devices:
        mem = 81920 * milli // 1000
        state.apply(Change(node, 0, 0, {j: milli}, {j: mem}, tag_of(1, milli < 1000), tier_code(req)))


def split_and_whole(cpu_second: int = 64000) -> ClusterState:
    """n0: free GPUs 2 + 2 over two groups; n1: free GPUs 4 in one group (the other group busy)."""
    state = ClusterState.from_nodes(
        [gpu_node("n0", ["a"] * 4 + ["b"] * 4), gpu_node("n1", ["a"] * 4 + ["b"] * 4, cpu_second)]
    )
    busy(state, 0, [0, 1, 4, 5])
    busy(state, 1, [4, 5, 6, 7])
    return state


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_node_where_the_devices_share_one_group_wins(policy: str) -> None:
    for seed in range(4):  # `random` too: every seed
        state = split_and_whole()
        d = Scheduler(make_scorer(policy, seed=seed)).place(state, whole(4))
        assert d.ok and d.placements[0].node_name == "n1", (policy, seed)
        assert {state.gpu_link[1, j] for j in d.placements[0].devices} == {state.gpu_link[1, 0]}


@pytest.mark.parametrize("policy", ["default", "bestfit", "firstfit", "packing", "clustering", "dotprod"])
def test_the_rule_overrides_what_the_policy_alone_would_choose(policy: str) -> None:
    # n1 has more CPU free, so score ties and `bestfit`/`dotprod` alike favour n0 without groups
    plain = split_and_whole(cpu_second=128000)
    plain.gpu_link = None
    assert Scheduler(make_scorer(policy)).place(plain, whole(4)).placements[0].node_name == "n0"
    d = Scheduler(make_scorer(policy)).place(split_and_whole(cpu_second=128000), whole(4))
    assert d.placements[0].node_name == "n1"


def test_fewer_groups_win_when_no_node_holds_it_in_one() -> None:
    # 6 GPUs: n0 has free 2 + 2 + 2 (three groups), n1 has free 4 + 2 (two groups)
    state = ClusterState.from_nodes(
        [gpu_node("n0", ["a"] * 3 + ["b"] * 3 + ["c"] * 3), gpu_node("n1", ["a"] * 5 + ["b"] * 4)]
    )
    busy(state, 0, [0, 3, 6])
    busy(state, 1, [0, 5, 6, 7])
    for policy in ALL_POLICIES:
        d = Scheduler(make_scorer(policy)).place(state, whole(5))
        assert d.ok and d.placements[0].node_name == "n1", policy


def test_single_device_and_fractional_single_requests_ignore_groups() -> None:
    state = split_and_whole(cpu_second=128000)
    assert Scheduler(make_scorer("bestfit")).place(state, whole(1)).placements[0].node_name == "n0"
    shared = Request(gpu_count=1, gpu_milli=300, sharing="shared")  # type: ignore[arg-type]
    assert Scheduler(make_scorer("bestfit")).place(state, shared).placements[0].node_name == "n0"


def test_groups_are_a_preference_and_explain_does_not_mention_them() -> None:
    state = split_and_whole()
    busy(state, 1, [0])  # n1: 3 free in one group; n0: 2 + 2 → only n0 holds 4
    sched = Scheduler(make_scorer("default"))
    d = sched.place(state, whole(4))
    assert d.ok and d.placements[0].node_name == "n0"  # split over two groups rather than wait
    no = sched.place(state, whole(5))
    assert not no.ok
    text = str(no.reasons).lower()
    assert "no 5 idle gpus" in text and "link" not in text and "group" not in text


def spread_oracle(links: list[int], usable: list[int], k: int) -> int:
    """The fewest groups holding k usable devices: smallest m whose m largest groups hold k."""
    sizes = sorted(Counter(links[j] if links[j] >= 0 else -1 - j for j in usable).values(), reverse=True)
    return next(m for m in range(1, len(sizes) + 1) if sum(sizes[:m]) >= k)


def plain_choice(sched: Scheduler, state: ClusterState, req: Request) -> tuple[np.ndarray, np.ndarray]:
    """The policy's own view, with no NVLink rule: feasible nodes and their scores."""
    view = state.node_view()
    ok, need = feasible(state, view, req)
    ok &= state.eligible(req)
    scores = np.full(state.n_nodes, -np.inf)
    if ok.any():
        idx = np.flatnonzero(ok)
        s, _ = sched.scorer.score(state, view.take(idx), req, _take_need(need, idx))
        scores[idx] = s
    return ok, scores


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.lists(
        st.lists(
            st.tuples(st.sampled_from(["", "nv0", "nv1", "nv2"]), st.sampled_from([0, 0, 1000, 500])),
            min_size=1,
            max_size=8,
        ),
        min_size=2,
        max_size=6,
    ),
    k=st.integers(1, 4),
    milli=st.sampled_from([1000, 1000, 400]),
    policy=st.sampled_from(ALL_POLICIES),
    linked=st.booleans(),
)
def test_node_choice_property(
    layout: list[list[tuple[str, int]]], k: int, milli: int, policy: str, linked: bool
) -> None:
    nodes = [gpu_node(f"n{i}", [g if linked else "" for g, _ in devs]) for i, devs in enumerate(layout)]
    state = ClusterState.from_nodes(nodes)
    for i, devs in enumerate(layout):
        for j, (_, used) in enumerate(devs):
            if used:
                busy(state, i, [j], used)
    shared = Request(gpu_count=1, gpu_milli=milli, sharing="shared") if milli < 1000 else None  # type: ignore[arg-type]
    req = shared or whole(k)  # a fraction is for one device only
    sched = Scheduler(make_scorer(policy, seed=3))
    d = sched.place(state, req, observe=False)
    ok, scores = plain_choice(sched, state, req)
    assert d.ok == bool(ok.any())
    if not d.ok:
        return
    got = d.placements[0].node
    if state.gpu_link is None or req.gpu_count == 1:  # the policy's plain choice, exactly as before
        if policy == "random":
            assert ok[got]
        else:
            assert got == int(np.argmax(scores)), (got, scores)
        return
    need = device_need(state, state.node_view(), req).usable
    links = state.gpu_link.tolist()
    spread = {
        i: spread_oracle(links[i], np.flatnonzero(need[i]).tolist(), k) for i in np.flatnonzero(ok).tolist()
    }
    fewest = min(spread.values())
    assert spread[got] == fewest
    if policy != "random":  # among the nodes with the fewest groups, the policy's best (lowest index on ties)
        among = np.where([spread.get(i) == fewest for i in range(state.n_nodes)], scores, -np.inf)
        assert got == int(np.argmax(among))
    assert spread_oracle(links[got], d.placements[0].devices, k) == fewest  # its devices too


@pytest.mark.parametrize("policy", ["default", "bestfit"])
def test_bench_workload_keeps_multi_gpu_requests_in_one_group(policy: str) -> None:
    from computepool.sim.synthetic import run_bench

    res = run_bench(60, 8, 2000, policy, 0, link_group_size=4)
    assert res.link_group_size == 4 and res.placed > 1900
    assert res.multi_gpu_split == 0  # every request of 2–4 GPUs got one group of four
    plain = run_bench(60, 8, 2000, policy, 0)
    assert plain.link_group_size == 0 and plain.multi_gpu_split == 0
