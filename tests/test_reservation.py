"""Reservation with backfill (scheduler/reservation.py), with the scheduler library directly.

Oracle for whole-node gangs on identical nodes, from the rule in docs/scheduler.md: a node is
clear when the last of its work ends; the gang of k nodes fits at the k-th earliest clear time,
which is unknown (None) when one of the k nodes holds work without a time limit.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from computepool.core import Device, Node, Request
from computepool.scheduler.placement import Scheduler
from computepool.scheduler.policies import make_scorer
from computepool.scheduler.reservation import Held, human_s, reserve, when
from computepool.scheduler.state import ClusterState

GPUS = 4


def cluster(n: int) -> ClusterState:
    return ClusterState.from_nodes(
        [
            Node(f"n{i}", 64000, 1 << 20, [Device(j, "nvidia", "A100", 81920) for j in range(GPUS)])
            for i in range(n)
        ]
    )


def hold(sched: Scheduler, state: ClusterState, key: int, node: int, ends_at: float | None) -> Held:
    """One single-GPU job on `node`, bound."""
    within = np.zeros(state.n_nodes, dtype=bool)
    within[node] = True
    d = sched.place(state, Request(gpu_count=1, gpu_milli=1000), within=within)
    assert d.ok
    Scheduler.commit(state, d)
    return Held(key, ends_at, tuple(p.change for p in d.placements))


GANG = Request(gpu_count=GPUS, gpu_milli=1000, gang_nodes=3)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    jobs=st.lists(
        st.tuples(st.integers(0, 4), st.one_of(st.none(), st.integers(1, 100).map(float))), max_size=14
    ),
    policy=st.sampled_from(["default", "bestfit", "firstfit"]),
)
def test_shadow_time_is_the_kth_earliest_clear_node(
    jobs: list[tuple[int, float | None]], policy: str
) -> None:
    state = cluster(5)
    sched = Scheduler(make_scorer(policy))
    held, per_node = [], [0] * 5
    for key, (node, end) in enumerate(jobs):
        if per_node[node] < GPUS:
            held.append(hold(sched, state, key, node, end))
            per_node[node] += 1
    before = (state.gpu_free.copy(), state.gpu_tier.copy(), state.gpu_slices.copy(), state.cpu_free.copy())
    res = reserve(sched, state, 99, GANG, held, now=0.0)
    after = (state.gpu_free, state.gpu_tier, state.gpu_slices, state.cpu_free)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)), "state not restored"

    clear: list[float] = []
    for node in range(5):
        ends = [h.ends_at for h in held if h.changes[0].node == node]
        clear.append(np.inf if None in ends else max([0.0, *(e for e in ends if e is not None)]))
    kth = sorted(clear)[GANG.gang_nodes - 1]
    assert res is not None and res.gang == 99 and len(res.nodes) == 3
    assert res.shadow == (None if kth == np.inf else kth)
    assert int(res.mask.sum()) == 3 and all(res.mask[i] for i in res.nodes)
    if res.shadow is not None:  # the nodes it takes are clear by then
        assert all(clear[i] <= res.shadow for i in res.nodes)


def test_backfill_admits_work_that_ends_before_the_shadow_time_only() -> None:
    state = cluster(3)
    sched = Scheduler(make_scorer("default"))
    held = [hold(sched, state, 1, 0, 600.0), hold(sched, state, 2, 1, 300.0)]
    res = reserve(sched, state, 7, GANG, held, now=0.0)
    assert res is not None and res.shadow == 600.0 and set(res.nodes) == {0, 1, 2}
    small = Request(gpu_count=1, gpu_milli=1000)
    # a job with a 5-minute limit ends before the gang can start: it may use the reserved nodes
    short = res.within(300.0)
    assert short is None and sched.place(state, small, within=short).ok
    # one without a limit, or with a longer one, may not (and nothing else is free here)
    for ends in (None, 900.0):
        keep_off = res.within(ends)
        assert keep_off is not None and not keep_off.any()
        assert not sched.place(state, small, within=keep_off).ok
    assert when(res) == "in ~10m" and human_s(res.free_in() or 0) == "10m"


def test_unknown_shadow_still_reserves_the_nodes() -> None:
    state = cluster(4)
    sched = Scheduler(make_scorer("default"))
    held = [hold(sched, state, 1, 0, None), hold(sched, state, 2, 1, 50.0), hold(sched, state, 3, 2, None)]
    res = reserve(sched, state, 5, GANG, held, now=0.0)
    assert res is not None and res.shadow is None
    assert res.mask[3] and res.mask[1]  # the free node and the one that clears by its limit
    assert not res.admits(10.0) and res.within(10.0) is not None
    assert "free up" in when(res)


def test_gang_that_fits_now_reserves_its_nodes_now() -> None:
    state = cluster(4)
    sched = Scheduler(make_scorer("default"))
    held = [hold(sched, state, 1, 0, 100.0)]
    res = reserve(sched, state, 5, GANG, held, now=0.0)
    assert res is not None and res.shadow == 0.0 and not res.mask[0]
    assert not res.admits(10.0)


def test_gang_that_can_never_fit_gets_no_reservation() -> None:
    state = cluster(2)
    sched = Scheduler(make_scorer("default"))
    held = [hold(sched, state, 1, 0, 100.0)]
    assert reserve(sched, state, 5, GANG, held, now=0.0) is None
    assert state.gpu_free[0].sum() == (GPUS - 1) * 1000  # left as it was
