"""Each policy's score on small clusters computed by hand, and the fragmentation measure behind fgd."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from computepool.core import Device, Node, Request
from computepool.scheduler.fragmentation import TypicalPods, frag_after_share, frag_amount, sigmoid_score
from computepool.scheduler.placement import Scheduler
from computepool.scheduler.policies import (
    POLICIES,
    BestFitScorer,
    ClusteringScorer,
    DefaultScorer,
    DotProdScorer,
    FGDScorer,
    OnlineTypical,
    PackingScorer,
    make_scorer,
)
from computepool.scheduler.state import TAG_CPU_ONLY, Change, ClusterState, tag_of


def node(
    name: str, gpus: int, *, cpu: int = 64000, mem: int = 262144, model: str = "T4", gmem: int = 16384
) -> Node:
    return Node(name, cpu, mem, [Device(j, "nvidia", model, gmem) for j in range(gpus)])


def occupy(state: ClusterState, i: int, used: dict[int, int], tag: int, cpu: int = 0) -> None:
    """Take `used[j]` milli of device j on node i (GPU memory in proportion) as one placement."""
    mem = {j: int(state.gpu_mem_cap[i, j]) * m // 1000 for j, m in used.items()}
    state.apply(
        Change(node=i, cpu_milli=cpu, memory_mib=0, gpu_milli=dict(used), gpu_memory_mib=mem, tag=tag)
    )


def scores(scorer, state: ClusterState, req: Request) -> list[float]:
    s, _ = scorer.score(state, state.node_view(), req, None)
    return [float(x) for x in s]


def sig(delta: float) -> int:
    """FGD's score by hand: 100·sigmoid(delta/1000), truncated."""
    return math.floor(100 / (1 + math.exp(-delta / 1000)))


# --- bestfit and dotprod -----------------------------------------------------------------------


def _three() -> ClusterState:
    return ClusterState.from_nodes(
        [node("a", 4, cpu=64000), node("b", 2, cpu=32000), node("c", 8, cpu=96000)]
    )


def test_bestfit_by_hand():
    state = _three()
    req = Request(gpu_count=1, gpu_milli=1000, cpu_milli=4000)
    # 1 − [0.5·(cpu_free − 4000)/128000 + 0.5·(gpu_left − 1000)/8000], ×100, truncated
    a = math.floor(100 * (1 - (0.5 * 60000 / 128000 + 0.5 * 3000 / 8000)))  # 57
    b = math.floor(100 * (1 - (0.5 * 28000 / 128000 + 0.5 * 1000 / 8000)))  # 82
    c = math.floor(100 * (1 - (0.5 * 92000 / 128000 + 0.5 * 7000 / 8000)))  # 20
    assert (a, b, c) == (57, 82, 20)
    assert scores(BestFitScorer(), state, req) == [a, b, c]
    d = Scheduler(make_scorer("bestfit")).place(state, req)
    assert d.placements[0].node == 1 and d.placements[0].score == 82


def test_bestfit_counts_a_fraction_as_its_milli():
    state = _three()
    req = Request(gpu_count=1, gpu_milli=250, cpu_milli=0)
    expected = [
        math.floor(100 * (1 - (0.5 * cpu / 128000 + 0.5 * (g - 250) / 8000)))
        for cpu, g in ((64000, 4000), (32000, 2000), (96000, 8000))
    ]
    assert scores(BestFitScorer(), state, req) == expected


def test_dotprod_by_hand():
    state = _three()
    req = Request(gpu_count=1, gpu_milli=1000, cpu_milli=4000)

    def dp(cpu_free: int, gpu_left: int) -> int:
        dot = (cpu_free / 128000) * (4000 / 128000) + (gpu_left / 8000) * (1000 / 8000)
        return math.floor(100 * (1 - dot / 2))

    expected = [dp(64000, 4000), dp(32000, 2000), dp(96000, 8000)]
    assert expected == [96, 98, 92]
    assert scores(DotProdScorer(), state, req) == expected
    d = Scheduler(make_scorer("dotprod")).place(state, req)
    assert d.placements[0].node == 1 and d.placements[0].score == 98


# --- packing -----------------------------------------------------------------------------------


def _packing_cluster() -> ClusterState:
    state = ClusterState.from_nodes([node("idle", 4), node("part", 4), node("whole", 4)])
    occupy(state, 1, {0: 500}, tag_of(1, True))  # a partly used GPU
    occupy(state, 2, {0: 1000}, tag_of(1, False))  # a used node with idle GPUs
    return state


def test_packing_prefers_partially_used_gpus():
    state = _packing_cluster()
    req = Request(gpu_count=1, gpu_milli=300)
    # idle node: max(33 − 4 idle, 4) = 29; part: max(100 − (500·100//1000)//10, 50) = 95;
    # whole: the fitting device is idle, max(50 − 1, 33) = 49
    assert scores(PackingScorer(), state, req) == [29, 95, 49]
    d = Scheduler(make_scorer("packing")).place(state, req)
    assert (d.placements[0].node, d.placements[0].devices) == (1, [0])


def test_packing_whole_devices_tie_to_lowest_index():
    state = _packing_cluster()
    req = Request(gpu_count=1, gpu_milli=1000)
    assert scores(PackingScorer(), state, req) == [29, 49, 49]
    d = Scheduler(make_scorer("packing")).place(state, req)
    assert (d.placements[0].node, d.placements[0].devices) == (1, [1])


def test_packing_fuller_device_scores_higher():
    state = ClusterState.from_nodes([node("a", 2), node("b", 2)])
    occupy(state, 0, {0: 400}, 0)  # 600 free
    occupy(state, 1, {1: 800}, 0)  # 200 free
    req = Request(gpu_count=1, gpu_milli=150)
    assert scores(PackingScorer(), state, req) == [100 - 6, 100 - 2]
    d = Scheduler(make_scorer("packing")).place(state, req)
    assert (d.placements[0].node, d.placements[0].devices) == (1, [1])


# --- clustering --------------------------------------------------------------------------------


def _clustering_cluster() -> ClusterState:
    state = ClusterState.from_nodes([node(f"n{i}", 4) for i in range(5)])
    occupy(state, 0, {0: 500}, tag_of(1, True))  # hosts shared work only
    occupy(state, 1, {0: 1000}, tag_of(1, False))  # hosts 1-GPU work only
    occupy(state, 3, {0: 500}, tag_of(1, True))  # hosts both
    occupy(state, 3, {1: 1000}, tag_of(1, False))
    occupy(state, 4, {}, TAG_CPU_ONLY, cpu=8000)  # CPU-only work: still "empty" for GPUs
    return state


def test_clustering_prefers_nodes_hosting_the_same_kind():
    state = _clustering_cluster()
    base = [25 * (8000 - left) // 8000 for left in (3500, 3000, 4000, 2500, 4000)]
    assert base == [14, 15, 12, 17, 12]
    frac = Request(gpu_count=1, gpu_milli=200)
    assert scores(ClusteringScorer(), state, frac) == [75 + 14, 0 + 15, 25 + 12, 50 + 17, 25 + 12]
    one = Request(gpu_count=1, gpu_milli=1000)
    assert scores(ClusteringScorer(), state, one) == [0 + 14, 75 + 15, 25 + 12, 50 + 17, 25 + 12]
    two = Request(gpu_count=2, gpu_milli=1000)
    assert scores(ClusteringScorer(), state, two) == [14, 15, 37, 17, 37]
    sched = Scheduler(make_scorer("clustering"))
    assert sched.place(state, frac).placements[0].node == 0
    assert sched.place(state, one).placements[0].node == 1
    assert sched.place(state, two).placements[0].node == 2  # empty nodes next; tie → lowest index
    assert sched.place(state, Request(cpu_milli=1000)).placements[0].node == 0  # CPU only: all 0


# --- fragmentation and fgd ---------------------------------------------------------------------


def _typical_half_and_whole() -> TypicalPods:
    typ = TypicalPods.from_requests(
        [Request(gpu_count=1, gpu_milli=500), Request(gpu_count=1, gpu_milli=1000)]
    )
    assert typ.milli.tolist() == [1000, 500]  # equal counts: larger milli first
    assert typ.weight.tolist() == [0.5, 0.5]
    return typ


def _acc(b: int, present: int, t: int, g: int = 8) -> np.ndarray:
    acc = np.zeros((b, g, t), dtype=bool)
    acc[:, :present, :] = True
    return acc


def test_frag_amount_by_hand():
    typ = _typical_half_and_whole()
    left = np.zeros((3, 8), dtype=np.int64)
    left[0, :2] = [1000, 1000]  # idle: every typical pod fits, no fragment
    left[1, :2] = [1000, 300]  # the 300 left on device 1 is too small for either: F = 300
    left[2, :2] = [700, 300]  # 500 fits (300 stranded); 1000 fits nowhere (all 1000): F = 650
    f = frag_amount(np.array([64000] * 3), left, _acc(3, 2, typ.size), typ)
    assert f.tolist() == [0.0, 0.5 * 300 + 0.5 * 300, 0.5 * 300 + 0.5 * 1000]


def test_frag_amount_cpu_model_and_cpu_only_typicals():
    left = np.array([[1000, 1000, 0, 0, 0, 0, 0, 0]])
    cpu_heavy = TypicalPods.from_requests([Request(gpu_count=1, gpu_milli=500, cpu_milli=8000)])
    assert frag_amount(np.array([4000]), left, _acc(1, 2, 1), cpu_heavy).tolist() == [2000.0]
    assert frag_amount(np.array([8000]), left, _acc(1, 2, 1), cpu_heavy).tolist() == [0.0]
    cpu_only = TypicalPods.from_requests([Request(cpu_milli=1000)])
    assert frag_amount(np.array([64000]), left, _acc(1, 2, 1), cpu_only).tolist() == [2000.0]
    pinned = TypicalPods.from_requests([Request(gpu_count=1, gpu_milli=1000, models=frozenset({"A100"}))])
    assert pinned.access(["T4", "A100"]).tolist() == [[False, True, False]]
    acc = pinned.access(["T4"]).T[np.array([[0, 0, -1, -1, -1, -1, -1, -1]])]
    assert frag_amount(np.array([64000]), left, acc, pinned).tolist() == [2000.0]
    empty = TypicalPods.from_counts(Counter())
    assert empty.size == 0
    assert frag_amount(np.array([1]), left, _acc(1, 2, 0), empty).tolist() == [0.0]


def test_fgd_picks_the_placement_adding_least_fragmentation():
    typ = _typical_half_and_whole()
    state = ClusterState.from_nodes([node("idle", 2), node("used", 2)])
    occupy(state, 1, {1: 700}, 0)  # node 1: free [1000, 300], F = 300
    req = Request(gpu_count=1, gpu_milli=300)
    # idle node, either device → [700, 1000]: F1 = 0.5·700 = 350, delta −350
    # used node, device 1 → [1000, 0]: F1 = 0, delta +300; device 0 → [700, 300]: F1 = 650, delta −350
    assert (sig(-350), sig(300)) == (41, 57)
    table = typ.access(state.models).T
    view = state.node_view()
    f0 = frag_amount(view.cpu_free, view.gpu_free, table[view.gpu_model], typ)
    assert f0.tolist() == [0.0, 300.0]
    d = Scheduler(FGDScorer(typ)).place(state, req)
    assert (d.placements[0].node, d.placements[0].devices, d.placements[0].score) == (1, [1], 57)
    # a whole device adds nothing on either node (delta 0, score 50): the tie goes to node 0
    d = Scheduler(FGDScorer(typ)).place(state, Request(gpu_count=1, gpu_milli=1000))
    assert (d.placements[0].node, d.placements[0].score) == (0, 50)


@settings(max_examples=80, deadline=None)
@given(
    left=st.lists(st.lists(st.integers(0, 1000), min_size=4, max_size=4), min_size=1, max_size=3),
    cpu_free=st.integers(0, 16000),
    shapes=st.lists(
        st.tuples(
            st.sampled_from([0, 2000, 8000]), st.sampled_from([0, 100, 300, 500, 1000]), st.integers(1, 3)
        ),
        min_size=1,
        max_size=4,
    ),
    milli=st.integers(1, 999),
    cpu=st.sampled_from([0, 1000, 4000]),
)
def test_frag_after_share_matches_recomputing(left, cpu_free, shapes, milli, cpu):
    """The incremental F after a fraction on device j equals F recomputed on the changed node."""
    reqs = [
        Request(cpu_milli=c) if m == 0 else Request(gpu_count=1 if m < 1000 else k, gpu_milli=m, cpu_milli=c)
        for c, m, k in shapes
    ]
    typ = TypicalPods.from_requests(reqs, coverage=1.0)
    arr = np.zeros((len(left), 8), dtype=np.int64)
    arr[:, :4] = left
    cpu_arr = np.full(len(left), cpu_free)
    acc = _acc(len(left), 4, typ.size)
    f0, f1 = frag_after_share(cpu_arr, arr, acc, typ, cpu, milli)
    assert np.allclose(f0, frag_amount(cpu_arr, arr, acc, typ))
    for b in range(len(left)):
        for j in range(4):
            if arr[b, j] < milli:
                continue
            after = arr[b : b + 1].copy()
            after[0, j] -= milli
            want = frag_amount(cpu_arr[b : b + 1] - cpu, after, acc[b : b + 1], typ)
            assert np.isclose(f1[b, j], want[0]), (b, j)


def test_sigmoid_score():
    assert sigmoid_score(np.array([0.0]), np.array([0.0])).tolist() == [50.0]
    assert sigmoid_score(np.array([1000.0]), np.array([0.0])).tolist() == [
        math.floor(100 / (1 + math.exp(-1)))
    ]


def test_typical_pods_coverage_and_order():
    a, b, c = (0, 500, 1, None), (0, 1000, 1, None), (0, 250, 1, None)
    typ = TypicalPods.from_counts(Counter({a: 6, b: 3, c: 1}), coverage=0.9)
    assert typ.milli.tolist() == [500, 1000]
    assert np.allclose(typ.weight, [6 / 9, 3 / 9])
    assert TypicalPods.from_counts(Counter({a: 6, b: 3, c: 1}), coverage=0.95).size == 3


def test_online_typical_learns_and_moves_epoch():
    learn = OnlineTypical()
    half, whole = Request(gpu_count=1, gpu_milli=500), Request(gpu_count=1, gpu_milli=1000)
    learn.observe(half)
    assert learn.epoch == 1 and learn.typical.milli.tolist() == [500]
    learn.observe(half)  # rebuilt, same shape and weights: cached scores stay valid
    assert learn.epoch == 1
    learn.observe(whole)
    learn.observe(whole)  # rebuilt at 4 requests: a new shape
    assert learn.epoch == 2
    assert sorted(learn.typical.milli.tolist()) == [500, 1000]


# --- ties, random, construction ----------------------------------------------------------------


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "random"])
@pytest.mark.parametrize(
    "req",
    [Request(gpu_count=1, gpu_milli=500), Request(gpu_count=2, gpu_milli=1000), Request(cpu_milli=1000)],
)
def test_ties_go_to_the_lowest_node_index(policy, req):
    state = ClusterState.from_nodes([node(f"n{i}", 4) for i in range(4)])
    sched = Scheduler(make_scorer(policy, typical=TypicalPods.from_requests([req])))
    d = sched.place(state, req)
    assert d.placements[0].node == 0


def _random_run(seed: int) -> list[tuple[int, tuple[int, ...]]]:
    state = ClusterState.from_nodes([node(f"n{i}", 4) for i in range(10)])
    sched = Scheduler(make_scorer("random", seed=seed))
    out = []
    for k in range(30):
        req = Request(gpu_count=1, gpu_milli=[250, 1000, 500][k % 3])
        d = sched.schedule(state, req)
        out.append((d.placements[0].node, tuple(d.placements[0].devices)))
    return out


def test_random_is_reproducible_per_seed():
    a = _random_run(7)
    assert a == _random_run(7)
    assert a != _random_run(8)
    assert len({n for n, _ in a}) > 3  # it does spread over nodes


def test_make_scorer_errors():
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_scorer("nope")
    with pytest.raises(ValueError, match="typical"):
        make_scorer("fgd")
    for p in POLICIES:
        assert make_scorer(p, typical=TypicalPods.from_counts(Counter())).name == p


# --- default: FGD learned online, softer temperature for fractions, exact device tie-break ------


def _learned(milli: int = 500, n: int = 100) -> OnlineTypical:
    learn = OnlineTypical()
    for _ in range(n):
        learn.observe(Request(gpu_count=1, gpu_milli=milli))
    assert learn.typical.milli.tolist() == [milli]
    return learn


def test_default_ties_nodes_within_its_temperature_to_the_lowest_index():
    state = ClusterState.from_nodes([node("idle", 1), node("used", 1)])
    occupy(state, 1, {0: 700}, 0)  # node 1 keeps 300 free: all of it a fragment for a 500m pod
    # 20m: node 0 adds no fragment (delta 0); node 1 turns 20 fragment milli into work (delta +20).
    # 100·sigmoid(20/4000) truncates to 50 like delta 0: one tie class, lowest index wins.
    assert math.floor(100 / (1 + math.exp(-20 / 4000))) == 50
    d = Scheduler(DefaultScorer(_learned())).place(state, Request(gpu_count=1, gpu_milli=20))
    assert (d.placements[0].node, d.placements[0].score) == (0, 50)
    # 300m: node 1 removes its whole 300 fragment, delta +300 → 100·sigmoid(300/4000) = 51;
    # node 0 leaves 700, still fine for a 500m pod, delta 0 → 50
    d = Scheduler(DefaultScorer(_learned())).place(state, Request(gpu_count=1, gpu_milli=300))
    assert (d.placements[0].node, d.placements[0].devices, d.placements[0].score) == (1, [0], 51)


def test_default_breaks_device_ties_by_exact_fragmentation_but_fgd_takes_the_first():
    state = ClusterState.from_nodes([node("a", 2)])
    occupy(state, 0, {1: 700}, 0)  # free [1000, 300]
    req = Request(gpu_count=1, gpu_milli=20)
    d = Scheduler(DefaultScorer(_learned())).place(state, req)
    assert d.placements[0].devices == [1]  # delta +20 beats delta 0 inside the tie class
    typ = TypicalPods.from_requests([Request(gpu_count=1, gpu_milli=500)])
    assert sig(20) == sig(0) == 50
    d = Scheduler(FGDScorer(typ)).place(state, req)
    assert d.placements[0].devices == [0]  # as published: the first device with the best score


@pytest.mark.parametrize("policy", ["fgd", "default"])
def test_uncached_scheduler_works_for_fgd(policy):
    req = Request(gpu_count=1, gpu_milli=500)
    state = ClusterState.from_nodes([node("a", 2), node("b", 2)])
    cached = Scheduler(make_scorer(policy, typical=TypicalPods.from_requests([req]))).place(state, req)
    direct = Scheduler(make_scorer(policy, typical=TypicalPods.from_requests([req])), cache=False).place(
        state, req
    )
    assert [(p.node, p.devices) for p in direct.placements] == [
        (p.node, p.devices) for p in cached.placements
    ]
