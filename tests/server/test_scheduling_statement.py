"""A cycle's tentative changes (`Statement`): evictions and restores roll back exactly, and a
preemption that cannot serve its claim leaves the world as it found it."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from computepool.server.scheduling import (
    DevSnap,
    Live,
    NodeSnap,
    Snapshot,
    build_world,
    decide,
)
from computepool.server.scheduling.world import World

NODES = 3
GPUS = 4


def _request(tenant: str, gpus: int, milli: int) -> dict[str, Any]:
    return {
        "gpus": gpus,
        "gpu_milli": milli,
        "gpu_memory_mib": None,
        "cpu_milli": 1000,
        "memory_mib": 1024,
        "models": None,
        "exclusive": False,
        "isolation": "timeslice" if milli < 1000 else "exclusive",
        "gang_nodes": 1,
        "priority": 0,
        "tenant": tenant,
        "name": "",
    }


def _bound_snapshot(shapes: list[tuple[str, int, int]], quotas: dict[str, Any] | None = None) -> Snapshot:
    """A pool whose allocations of `shapes` (tenant, gpus, milli) are bound where one cycle put them."""
    nodes = [
        NodeSnap(
            name=f"n{i}",
            cpu_milli=64_000,
            memory_mib=262_144,
            devices=tuple(DevSnap(j, "A100", 81920, 1000, f"GPU-{i}-{j}") for j in range(GPUS)),
            state="ready",
            cordoned=False,
        )
        for i in range(NODES)
    ]
    live = [
        Live(k + 1, t, "pending", _request(t, g, m), 0, 1, True, False, [], [], "", None)
        for k, (t, g, m) in enumerate(shapes)
    ]
    weights = {"a": 1.0, "b": 1.0}
    snap = Snapshot(nodes=nodes, weights=weights, quotas=quotas or {"a": {}, "b": {}}, live=live)
    binds = {b.id: b for b in decide(snap).binds}
    snap.live = [a for a in live if a.id in binds]
    for a in snap.live:
        a.state, a.nodes, a.slices = "bound", binds[a.id].nodes, binds[a.id].slices
    return snap


def _picture(w: World) -> tuple[Any, ...]:
    s = w.state
    usage = {t: {k: v for k, v in u.items() if v} for t, u in w.usage.items()}
    return (
        s.cpu_free.tolist(),
        s.mem_free.tolist(),
        np.asarray(s.gpu_free).tolist(),
        np.asarray(s.gpu_mem_free).tolist(),
        s.kinds.tolist(),
        usage,
        sorted(w.held),
    )


SHAPES = st.lists(
    st.tuples(st.sampled_from(["a", "b"]), st.integers(1, 2), st.sampled_from([250, 500, 1000])).map(
        lambda s: s if s[1] == 1 else (s[0], s[1], 1000)  # a fraction is of one device only
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=60, deadline=None)
@given(
    shapes=SHAPES,
    ops=st.lists(st.tuples(st.sampled_from(["evict", "restore", "cp", "back"]), st.integers(0, 20))),
)
def test_rollback_restores_the_world_exactly(
    shapes: list[tuple[str, int, int]], ops: list[tuple[str, int]]
) -> None:
    snap = _bound_snapshot(shapes)
    world, running, _ = build_world(snap)
    before = _picture(world)
    stmt = world.statement()
    out: list[Live] = []
    marks: list[tuple[int, tuple[Any, ...], list[int]]] = []
    for op, k in ops:
        inside = [a for a in running if a.id in world.held]
        if op == "evict" and inside:
            a = inside[k % len(inside)]
            stmt.evict(a)
            out.append(a)
        elif op == "restore" and out:
            stmt.restore(out.pop(k % len(out)))
        elif op == "cp":
            marks.append((stmt.checkpoint(), _picture(world), sorted(a.id for a in out)))
        elif op == "back" and marks:
            cp, picture, evicted = marks.pop()
            stmt.rollback(cp)
            assert _picture(world) == picture
            out = [a for a in running if a.id in evicted]
        assert sorted(a.id for a in stmt.evicted()) == sorted(a.id for a in out)
        assert all(a.id not in world.held for a in out)
    stmt.rollback()
    assert _picture(world) == before
    assert stmt.evicted() == []


def test_failed_preemption_leaves_no_trace() -> None:
    # b fills the pool, guaranteed all of it but one GPU: one eviction at most. a's guaranteed
    # claim of 2 GPUs on one node cannot be served by it, so the statement is rolled back — and
    # b's own next request must not find the GPU that was tentatively freed.
    full = NODES * GPUS * 1000
    host = {("", "cpu_milli"): (100_000, 100_000), ("", "memory_mib"): (100_000, 100_000)}
    quotas = {
        "a": {("", "gpu_milli"): (2000, 2000), **host},
        "b": {("", "gpu_milli"): (full - 1000, full), ("", "cpu_milli"): (0, 10**6)},
    }
    snap = _bound_snapshot([("b", 1, 1000)] * (NODES * GPUS), quotas)
    assert len(snap.live) == NODES * GPUS
    pending = [
        Live(900, "a", "pending", _request("a", 2, 1000), 0, 1, True, False, [], [], "", None),
        Live(901, "b", "pending", _request("b", 1, 1000), 0, 1, True, False, [], [], "", None),
    ]
    snap.live.extend(pending)
    plan = decide(snap)
    assert plan.binds == [] and plan.stops == []
    assert set(plan.reasons) == {900, 901}

    # the same claim for one GPU: one victim is enough, and exactly one is taken
    pending[0] = Live(902, "a", "pending", _request("a", 1, 1000), 0, 1, True, False, [], [], "", None)
    snap.live[-2:] = pending
    plan = decide(snap)
    assert [b.id for b in plan.binds] == [902]
    assert len(plan.stops) == 1 and plan.stops[0].state == "preempted"
    assert plan.binds[0].preempted == (plan.stops[0].id,)
