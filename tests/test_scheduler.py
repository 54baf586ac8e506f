"""scheduler/: invariants under random clusters and request sequences, for every policy.

The oracle here is written from the rules in docs/architecture.md and the trace README, not from the
scheduler's code: a node fits a request when it is schedulable, host CPU and memory fit, and
it has `gpu_count` allowed devices that are wholly idle (whole or exclusive requests) or that
have the request's compute and GPU memory free (a fraction of one device).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from computepool.core import Device, Node, Request, Sharing
from computepool.scheduler.filters import explain, feasibility, feasible, node_feasible
from computepool.scheduler.fragmentation import TypicalPods
from computepool.scheduler.placement import Decision, Scheduler
from computepool.scheduler.policies import POLICIES, make_scorer
from computepool.scheduler.state import Change, ClusterState, tag_of

MODELS = ["A100", "T4", "V100M32"]

# --- strategies --------------------------------------------------------------------------------


@st.composite
def nodes_st(draw, min_nodes: int = 2, max_nodes: int = 5) -> list[Node]:
    n = draw(st.integers(min_nodes, max_nodes))
    nodes = []
    for i in range(n):
        g = draw(st.sampled_from([0, 1, 2, 2, 4, 4, 8, 8]))
        model = draw(st.sampled_from(MODELS))
        gmem = draw(st.sampled_from([0, 16384, 81920]))
        devices = [Device(index=j, vendor="nvidia", model=model, memory_mib=gmem) for j in range(g)]
        nodes.append(
            Node(
                name=f"n{i}",
                cpu_milli=draw(st.sampled_from([8000, 32000, 96000])),
                memory_mib=draw(st.sampled_from([16384, 65536, 262144])),
                devices=devices,
                schedulable=draw(st.sampled_from([True, True, True, True, False])),
            )
        )
    return nodes


_cpu = st.sampled_from([0, 1000, 4000, 16000])
_mem = st.sampled_from([0, 1024, 16384])
_models = st.one_of(
    st.none(),
    st.frozensets(st.sampled_from([*MODELS, "H100"]), min_size=1, max_size=2),
)

requests_st = st.one_of(
    # a fraction of one device
    st.builds(
        Request,
        gpu_count=st.just(1),
        gpu_milli=st.one_of(st.sampled_from([100, 250, 500, 810, 999]), st.integers(1, 999)),
        gpu_memory_mib=st.sampled_from([None, None, 0, 1024, 20000]),
        cpu_milli=_cpu,
        memory_mib=_mem,
        models=_models,
    ),
    # whole devices, shared or exclusive
    st.builds(
        Request,
        gpu_count=st.sampled_from([1, 1, 2, 3, 4, 8]),
        gpu_milli=st.just(1000),
        cpu_milli=_cpu,
        memory_mib=_mem,
        models=_models,
        sharing=st.sampled_from([Sharing.SHARED, Sharing.EXCLUSIVE]),
    ),
    # CPU only
    st.builds(Request, cpu_milli=st.sampled_from([500, 4000, 16000]), memory_mib=_mem),
    # gangs over 2-3 nodes
    st.builds(
        Request,
        gpu_count=st.sampled_from([1, 2, 4]),
        gpu_milli=st.just(1000),
        cpu_milli=_cpu,
        memory_mib=_mem,
        gang_nodes=st.sampled_from([2, 3]),
        sharing=st.sampled_from([Sharing.SHARED, Sharing.EXCLUSIVE]),
    ),
)

ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("place"), requests_st),
        st.tuples(st.just("place"), requests_st),
        st.tuples(st.just("place"), requests_st),
        st.tuples(st.just("release"), st.integers(0, 1000)),
    ),
    min_size=1,
    max_size=25,
)


# --- a shadow of the pool, kept by hand ----------------------------------------------------------


@dataclass
class Shadow:
    """Free capacity tracked from the decisions alone, independent of ClusterState."""

    nodes: list[Node]
    cpu: list[int] = field(init=False)
    mem: list[int] = field(init=False)
    gfree: list[list[int]] = field(init=False)
    gmem: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.cpu = [n.cpu_milli for n in self.nodes]
        self.mem = [n.memory_mib for n in self.nodes]
        self.gfree = [[d.compute_milli for d in n.devices] for n in self.nodes]
        self.gmem = [[d.memory_mib for d in n.devices] for n in self.nodes]

    def need(self, req: Request, i: int, j: int) -> tuple[int, int]:
        dev = self.nodes[i].devices[j]
        if req.gpu_milli >= 1000:
            return dev.compute_milli, dev.memory_mib
        mem = dev.memory_mib * req.gpu_milli // 1000 if req.gpu_memory_mib is None else req.gpu_memory_mib
        return req.gpu_milli, mem

    def usable(self, req: Request, i: int, j: int) -> bool:
        dev = self.nodes[i].devices[j]
        if req.models is not None and dev.model not in req.models:
            return False
        if req.gpu_milli >= 1000 or req.sharing == Sharing.EXCLUSIVE:
            return self.gfree[i][j] == dev.compute_milli and self.gmem[i][j] == dev.memory_mib
        milli, mem = self.need(req, i, j)
        return self.gfree[i][j] >= milli and self.gmem[i][j] >= mem

    def fits(self, req: Request, i: int) -> bool:
        node = self.nodes[i]
        if not node.schedulable or self.cpu[i] < req.cpu_milli or self.mem[i] < req.memory_mib:
            return False
        return sum(self.usable(req, i, j) for j in range(len(node.devices))) >= req.gpu_count

    def feasible_nodes(self, req: Request) -> list[int]:
        return [i for i in range(len(self.nodes)) if self.fits(req, i)]

    def apply(self, req: Request, node: int, devices: list[int], sign: int) -> None:
        self.cpu[node] -= sign * req.cpu_milli
        self.mem[node] -= sign * req.memory_mib
        for j in devices:
            milli, mem = self.need(req, node, j)
            self.gfree[node][j] -= sign * milli
            self.gmem[node][j] -= sign * mem

    def assert_matches(self, state: ClusterState) -> None:
        for i, node in enumerate(self.nodes):
            g = len(node.devices)
            assert state.cpu_free[i] == self.cpu[i]
            assert state.mem_free[i] == self.mem[i]
            assert state.gpu_free[i, :g].tolist() == self.gfree[i]
            assert state.gpu_mem_free[i, :g].tolist() == self.gmem[i]
            assert state.gpu_left[i] == sum(self.gfree[i])
            idle = sum(
                self.gfree[i][j] == d.compute_milli and self.gmem[i][j] == d.memory_mib
                for j, d in enumerate(node.devices)
            )
            assert state.idle_devices[i] == idle


def snapshot(state: ClusterState) -> dict[str, bytes]:
    """Every capacity array of the state, as bytes (for byte-identical comparisons)."""
    names = [
        "cpu_free",
        "mem_free",
        "gpu_free",
        "gpu_mem_free",
        "kinds",
        "hosted",
        "idle_devices",
        "gpu_left",
        "cpu_cap",
        "mem_cap",
        "gpu_cap",
        "gpu_mem_cap",
        "schedulable",
    ]
    return {k: np.ascontiguousarray(getattr(state, k)).tobytes() for k in names}


def decision_key(d: Decision) -> tuple:
    return (d.ok, tuple((p.node, tuple(p.devices)) for p in d.placements))


def _scorer(policy: str, seed: int, reqs: list[Request]):
    return make_scorer(policy, seed=seed, typical=TypicalPods.from_requests(reqs))


def run_sequence(nodes: list[Node], ops: list, policy: str, seed: int, *, check: bool = True) -> list[tuple]:
    """Play `ops` against a fresh state; assert every invariant after every step when `check`."""
    reqs = [r for op, r in ops if op == "place"]
    state = ClusterState.from_nodes(nodes)
    shadow = Shadow(nodes)
    scorer = _scorer(policy, seed, reqs)
    sched = Scheduler(scorer)
    live: list[Decision] = []
    trail: list[tuple] = []
    n = len(nodes)
    for op, arg in ops:
        if op == "release":
            if not live:
                continue
            d = live.pop(arg % len(live))
            sched.release(state, d)
            for p in d.placements:
                shadow.apply(d.request, p.node, p.devices, -1)
            trail.append(("release", decision_key(d)))
        else:
            req: Request = arg
            before = snapshot(state)
            d = sched.place(state, req)
            trail.append(("place", decision_key(d)))
            if not check:
                if d.ok:
                    sched.commit(state, d)
                    live.append(d)
                continue
            # place() never changes the state, whatever the outcome (gangs undo their members)
            assert snapshot(state) == before
            feasible = shadow.feasible_nodes(req)
            if d.ok:
                assert d.reasons is None
                assert len(d.placements) == req.gang_nodes
                assert len({p.node for p in d.placements}) == req.gang_nodes, "gang members share a node"
                for p in d.placements:
                    assert p.node in feasible, (p.node, feasible)
                    assert p.node_name == nodes[p.node].name
                    assert len(p.devices) == len(set(p.devices)) == req.gpu_count
                    for j in p.devices:
                        assert j < len(nodes[p.node].devices)
                        assert shadow.usable(req, p.node, j), (p.node, j)
                        assert (p.change.gpu_milli[j], p.change.gpu_memory_mib[j]) == shadow.need(
                            req, p.node, j
                        )
                    assert p.change.cpu_milli == req.cpu_milli and p.change.memory_mib == req.memory_mib
                    assert p.change.tag == tag_of(req.gpu_count, req.fractional)
                # the class cache gives what a fresh scheduler computes from scratch
                if policy != "random":
                    fresh = Scheduler(scorer).place(state, req, observe=False)
                    assert decision_key(fresh) == decision_key(d)
                sched.commit(state, d)
                live.append(d)
                for p in d.placements:
                    shadow.apply(req, p.node, p.devices, +1)
                    if req.gpu_milli >= 1000:  # whole and exclusive: alone on their devices
                        for j in p.devices:
                            assert state.gpu_free[p.node, j] == 0
                            assert state.gpu_mem_free[p.node, j] == 0
            else:
                assert d.placements == []
                assert len(feasible) < req.gang_nodes, f"{req} fits on {feasible} but was refused"
                r = d.reasons
                assert r is not None and r.total_nodes == n
                assert sum(r.counts.values()) == n - len(feasible), (str(r), feasible)
                assert all(v > 0 for v in r.counts.values())
                if req.gang_nodes > 1:
                    assert any("gang needs" in note for note in r.notes)
                # the explanation of the pending request is the same as asking explain() directly
                assert r.counts == explain(state, req).counts
            state.check_invariants()
            shadow.assert_matches(state)
            # nothing else may land on a device that a whole or exclusive placement holds
            for other in live:
                if other.request.gpu_milli >= 1000:
                    for p in other.placements:
                        for j in p.devices:
                            assert state.gpu_free[p.node, j] == 0
    if check:
        # release everything: back to the empty pool, class table included
        for d in reversed(live):
            sched.release(state, d)
        state.check_invariants()
        assert (state.cpu_free == state.cpu_cap).all()
        assert (state.mem_free == state.mem_cap).all()
        assert (state.gpu_free == state.gpu_cap).all()
        assert (state.gpu_mem_free == state.gpu_mem_cap).all()
        assert (state.kinds == 0).all() and (state.hosted == 0).all()
        assert state.idle_devices.tolist() == [len(nd.devices) for nd in nodes]
        fresh = ClusterState.from_nodes(nodes)
        assert state.live_classes == fresh.live_classes
        for i in range(n):
            for k in range(n):
                assert (state.class_of[i] == state.class_of[k]) == (fresh.class_of[i] == fresh.class_of[k])
    return trail


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=nodes_st(), ops=ops_st, seed=st.integers(0, 2**16))
def test_invariants_every_step(policy, nodes, ops, seed):
    run_sequence(nodes, ops, policy, seed)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=nodes_st(), ops=ops_st, seed=st.integers(0, 2**16))
def test_same_seed_same_decisions(policy, nodes, ops, seed):
    a = run_sequence(nodes, ops, policy, seed, check=False)
    b = run_sequence(nodes, ops, policy, seed, check=False)
    assert a == b


@settings(max_examples=60, deadline=None)
@given(nodes=nodes_st(min_nodes=3, max_nodes=6), ops=ops_st)
def test_bestfit_and_dotprod_choose_best_score_lowest_index(nodes, ops):
    """The winner has the highest published score among feasible nodes; ties go to the lowest index."""

    def bestfit(shadow, i, req):
        s = (
            0.5 * (shadow.cpu[i] - req.cpu_milli) / 128000
            + 0.5 * (sum(shadow.gfree[i]) - req.gpu_count * req.gpu_milli) / 8000
        )
        return np.floor((1 - s) * 100)

    def dotprod(shadow, i, req):
        dot = (shadow.cpu[i] / 128000) * (req.cpu_milli / 128000) + (sum(shadow.gfree[i]) / 8000) * (
            req.gpu_count * req.gpu_milli / 8000
        )
        return np.floor(100 * (1 - dot / 2))

    for policy, formula in (("bestfit", bestfit), ("dotprod", dotprod)):
        state = ClusterState.from_nodes(nodes)
        shadow = Shadow(nodes)
        sched = Scheduler(make_scorer(policy))
        live: list[Decision] = []
        for op, req in ops:
            if op == "release" and live:
                gone = live.pop(req % len(live))
                sched.release(state, gone)
                for p in gone.placements:
                    shadow.apply(gone.request, p.node, p.devices, -1)
                continue
            if op != "place" or req.gang_nodes > 1:
                continue
            feasible = shadow.feasible_nodes(req)
            scores = {i: formula(shadow, i, req) for i in feasible}
            d = sched.place(state, req)
            assert d.ok == bool(feasible)
            if not d.ok:
                continue
            p = d.placements[0]
            best = max(scores.values())
            assert p.node == min(i for i, s in scores.items() if s == best), (policy, scores, p.node)
            assert p.score == best
            # best fit inside the node: least free compute, then GPU memory, then lowest index
            usable = [j for j in range(len(nodes[p.node].devices)) if shadow.usable(req, p.node, j)]
            usable.sort(key=lambda j: (shadow.gfree[p.node][j], shadow.gmem[p.node][j], j))
            assert sorted(p.devices) == sorted(usable[: req.gpu_count])
            sched.commit(state, d)
            live.append(d)
            shadow.apply(req, p.node, p.devices, +1)


# --- examples ----------------------------------------------------------------------------------


def node(
    name: str,
    gpus: int,
    *,
    model: str = "T4",
    cpu: int = 32000,
    mem: int = 65536,
    gmem: int = 16384,
    schedulable: bool = True,
) -> Node:
    return Node(
        name=name,
        cpu_milli=cpu,
        memory_mib=mem,
        devices=[Device(index=j, vendor="nvidia", model=model, memory_mib=gmem) for j in range(gpus)],
        schedulable=schedulable,
    )


def test_gang_is_all_or_nothing_and_state_untouched():
    nodes = [node("a", 4), node("b", 4), node("c", 2)]
    state = ClusterState.from_nodes(nodes)
    sched = Scheduler(make_scorer("bestfit"))
    before = snapshot(state)
    gang = Request(gpu_count=4, gpu_milli=1000, gang_nodes=3)
    d = sched.place(state, gang)
    assert not d.ok and d.placements == []
    assert snapshot(state) == before
    assert d.reasons is not None
    assert d.reasons.counts == Counter({"fewer than 4 GPUs": 1})
    assert d.reasons.notes == ["gang needs 3 nodes, only 2 fit"]
    assert "gang needs 3 nodes, only 2 fit" in str(d.reasons)

    ok = sched.schedule(state, Request(gpu_count=4, gpu_milli=1000, gang_nodes=2))
    assert ok.ok and sorted(p.node for p in ok.placements) == [0, 1]
    assert state.idle_devices.tolist() == [0, 0, 2]


@pytest.mark.parametrize("policy", POLICIES)
def test_gang_failure_byte_identical_for_every_policy(policy):
    nodes = [node("a", 2), node("b", 2), node("c", 8, cpu=4000)]
    reqs = [
        Request(gpu_count=1, gpu_milli=300),
        Request(gpu_count=2, gpu_milli=1000, cpu_milli=8000, gang_nodes=3),
    ]
    state = ClusterState.from_nodes(nodes)
    sched = Scheduler(_scorer(policy, 1, reqs))
    assert sched.schedule(state, reqs[0]).ok
    before = snapshot(state)
    d = sched.place(state, reqs[1])
    assert not d.ok
    assert snapshot(state) == before
    state.check_invariants()


def test_exclusive_takes_idle_devices_only():
    state = ClusterState.from_nodes([node("a", 2), node("b", 2)])
    sched = Scheduler(make_scorer("bestfit"))
    frac = sched.schedule(state, Request(gpu_count=1, gpu_milli=100))
    assert frac.ok
    used = (frac.placements[0].node, frac.placements[0].devices[0])
    ex = sched.schedule(state, Request(gpu_count=2, gpu_milli=1000, sharing=Sharing.EXCLUSIVE))
    assert ex.ok
    assert ex.placements[0].node != used[0]
    # nothing fits any more on the exclusive devices, even 1 milli
    tiny = sched.schedule(state, Request(gpu_count=1, gpu_milli=1, gpu_memory_mib=0))
    assert tiny.ok and tiny.placements[0].node == used[0]
    j = ex.placements[0].node
    assert state.gpu_free[j, :2].tolist() == [0, 0]
    # release gives the exclusive devices back whole
    sched.release(state, ex)
    assert state.idle_devices[j] == 2


def test_unschedulable_nodes_are_skipped_and_explained():
    nodes = [node("a", 2, schedulable=False), node("b", 2)]
    state = ClusterState.from_nodes(nodes)
    for policy in POLICIES:
        sched = Scheduler(_scorer(policy, 0, [Request(gpu_count=2, gpu_milli=1000)]))
        d = sched.place(state, Request(gpu_count=2, gpu_milli=1000))
        assert d.ok and d.placements[0].node == 1, policy
    state.set_schedulable(1, False)
    d = Scheduler(make_scorer("bestfit")).place(state, Request(cpu_milli=1))
    assert not d.ok
    assert d.reasons.counts == Counter({"not schedulable": 2})


def test_apply_undo_roundtrip_and_copy_independent():
    state = ClusterState.from_nodes([node("a", 4), node("b", 4)])
    before = snapshot(state)
    sched = Scheduler(make_scorer("packing"))
    d = sched.place(state, Request(gpu_count=1, gpu_milli=500, cpu_milli=1000))
    cp = state.copy()
    sched.commit(state, d)
    assert snapshot(cp) == before  # the copy did not move
    assert state.gpu_allocated_milli() == 500
    sched.release(state, d)
    assert snapshot(state) == before
    assert state.gpu_capacity_milli() == 8000


# --- explain -----------------------------------------------------------------------------------


def _busy_cluster() -> tuple[ClusterState, Scheduler]:
    """Three 2-GPU nodes where every GPU has exactly 500m (and 8 GiB) free."""
    state = ClusterState.from_nodes([node(f"n{i}", 2) for i in range(3)])
    for i in range(3):
        for j in range(2):
            state.apply(
                Change(node=i, cpu_milli=0, memory_mib=0, gpu_milli={j: 500}, gpu_memory_mib={j: 8192}, tag=0)
            )
    return state, Scheduler(make_scorer("bestfit"))


def test_explain_no_gpu_with_enough_free():
    state, sched = _busy_cluster()
    d = sched.place(state, Request(gpu_count=1, gpu_milli=810))
    assert not d.ok
    summary = d.reasons.to_dict()["summary"]
    assert "no GPU with 810m free" in summary
    assert summary.startswith("3 nodes: 3 no GPU with 810m free")
    assert d.reasons.to_dict()["counts"] == {"no GPU with 810m free": 3}


def test_explain_model_not_allowed():
    state = ClusterState.from_nodes([node("a", 2, model="T4"), node("b", 2, model="T4")])
    req = Request(gpu_count=1, gpu_milli=1000, models=frozenset({"H100"}))
    d = Scheduler(make_scorer("bestfit")).place(state, req)
    assert not d.ok
    assert "model not allowed" in str(d.reasons)
    assert d.reasons.counts == Counter({"model not allowed": 2})


def test_explain_each_filter_named():
    nodes = [
        node("small-cpu", 4, cpu=1000),
        node("small-mem", 4, mem=1024),
        node("two-gpus", 2, model="A100"),
        node("cpu-only", 0),
        node("busy", 4),
    ]
    state = ClusterState.from_nodes(nodes)
    for j in range(4):  # 100m taken on every device of "busy"
        state.apply(
            Change(node=4, cpu_milli=0, memory_mib=0, gpu_milli={j: 100}, gpu_memory_mib={j: 0}, tag=0)
        )
    req = Request(gpu_count=4, gpu_milli=1000, cpu_milli=2000, memory_mib=2048)
    r = explain(state, req)
    assert r.total_nodes == 5
    assert r.counts == Counter({"fewer than 4 GPUs": 2, "CPU": 1, "host memory": 1, "no 4 idle GPUs": 1})
    assert str(r).startswith("5 nodes: 2 fewer than 4 GPUs, ")
    d = Scheduler(make_scorer("bestfit")).place(state, req)
    assert not d.ok and d.reasons.counts == r.counts
    # a model constraint is checked first
    r2 = explain(state, Request(gpu_count=1, gpu_milli=1000, models=frozenset({"A100"})))
    assert r2.counts == Counter({"model not allowed": 4})


def test_explain_labels_for_whole_and_memory():
    state, _ = _busy_cluster()
    assert explain(state, Request(gpu_count=1, gpu_milli=1000)).counts == Counter({"no idle GPU": 3})
    assert explain(state, Request(gpu_count=2, gpu_milli=1000)).counts == Counter({"no 2 idle GPUs": 3})
    assert explain(state, Request(gpu_count=2, gpu_milli=1000, sharing=Sharing.EXCLUSIVE)).counts == Counter(
        {"no 2 exclusive idle GPUs": 3}
    )
    # 100m compute is free everywhere, but not 9 GiB of GPU memory (8 GiB left per device)
    r = explain(state, Request(gpu_count=1, gpu_milli=100, gpu_memory_mib=9 * 1024))
    assert r.counts == Counter({"no GPU with 9GiB GPU memory free": 3})
    assert explain(state, Request(cpu_milli=10**9)).counts == Counter({"CPU": 3})
    assert explain(state, Request(memory_mib=10**9)).counts == Counter({"host memory": 3})
    ok = explain(state, Request(gpu_count=1, gpu_milli=500))
    assert not ok.counts and str(ok) == "3 nodes: none rejected"


@pytest.mark.parametrize("policy", ["bestfit", "dotprod", "packing", "clustering"])
def test_best_fit_device_inside_the_node(policy):
    """A fraction goes to the device with the least free compute, not the lowest index."""
    state = ClusterState.from_nodes([node("a", 3)])
    sched = Scheduler(make_scorer(policy))
    whole = sched.schedule(state, Request(gpu_count=1, gpu_milli=1000))
    assert whole.placements[0].devices == [0]
    part = sched.schedule(state, Request(gpu_count=1, gpu_milli=300))
    assert part.placements[0].devices == [1]
    sched.release(state, whole)  # free: [1000, 700, 1000]
    d = sched.schedule(state, Request(gpu_count=1, gpu_milli=200))
    assert d.placements[0].devices == [1]
    # two whole devices: the idle ones, lowest index first
    d2 = sched.schedule(state, Request(gpu_count=2, gpu_milli=1000))
    assert d2.placements[0].devices == [0, 2]


@settings(max_examples=80, deadline=None)
@given(nodes=nodes_st(), ops=ops_st, probes=st.lists(requests_st, min_size=1, max_size=6))
def test_the_hot_path_the_node_path_and_explain_agree_on_feasibility(nodes, ops, probes):
    """The filters are written three ways for speed (classes on the hot path, nodes straight, and
    with reasons for explain): whatever the pool holds, all three keep the same nodes."""
    state = ClusterState.from_nodes(nodes)
    sched = Scheduler(make_scorer("default"))
    live: list[Decision] = []
    for op, arg in ops:
        if op == "release" and live:
            sched.release(state, live.pop(arg % len(live)))
        elif op == "place" and (d := sched.place(state, arg)).ok:
            sched.commit(state, d)
            live.append(d)
    view = state.node_view()
    # and requests that fit some device exactly, where a bound written one way and not another shows
    free = sorted({int(v) for v in np.asarray(state.gpu_free).ravel() if 0 < v < 1000})
    exact = [Request(gpu_count=1, gpu_milli=v, cpu_milli=0, memory_mib=0) for v in free[:6]]
    for req in [*probes, *exact]:
        hot, _need = feasible(state, view, req)
        with_reasons = feasibility(state, view, req)
        assert (with_reasons.ok == hot).all(), req
        assert (node_feasible(state, req) == (hot & state.eligible(req))).all(), req
