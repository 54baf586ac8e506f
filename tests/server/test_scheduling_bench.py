"""How long one scheduling cycle's decisions take on a large pool (printed, never asserted).
(`cpool bench cycle` times whole cycles, database included.)

`CPOOL_BENCH_FULL=1 python -m pytest tests/server/test_scheduling_bench.py -s` measures the
target size: 1,000 nodes x 8 GPUs and 10,000 pending requests. By default a tenth of it runs,
so the test suite stays quick; either way the decisions are checked for sanity.
"""

from __future__ import annotations

import json
import os
import time

from computepool.server.bench_cycle import request_doc
from computepool.server.scheduling import DevSnap, Live, NodeSnap, Snapshot, decide


def make_snapshot(nodes: int, pending: int, tenants: int = 8) -> Snapshot:
    node_snaps = [
        NodeSnap(
            name=f"node-{i:05d}",
            cpu_milli=128_000,
            memory_mib=1_048_576,
            devices=tuple(
                DevSnap(j, "A100" if i % 4 else "V100", 81920, 1000, f"GPU-{i}-{j}") for j in range(8)
            ),
            state="ready",
            cordoned=False,
        )
        for i in range(nodes)
    ]
    live = []
    for k in range(pending):
        tenant = f"t{k % tenants}"
        req = request_doc(k, tenant)  # the mix `cpool bench cycle` submits
        live.append(Live(k + 1, tenant, "pending", req, k % 3, 1, False, False, [], [], "", None))
    weights = {f"t{i}": 1.0 + i % 3 for i in range(tenants)}
    return Snapshot(nodes=node_snaps, weights=weights, quotas={t: {} for t in weights}, live=live)


def test_cycle_decision_time() -> None:
    full = os.environ.get("CPOOL_BENCH_FULL") == "1"
    nodes, pending = (1000, 10_000) if full else (100, 1000)
    snap = make_snapshot(nodes, pending)
    t0 = time.perf_counter()
    plan = decide(snap)
    first = time.perf_counter() - t0
    # a steady-state cycle: everything that fitted is bound, the rest still waits
    bound = {b.id: b for b in plan.binds}
    for a in snap.live:
        b = bound.get(a.id)
        if b is not None:
            a.state, a.nodes, a.slices = "bound", b.nodes, b.slices
    t1 = time.perf_counter()
    again = decide(snap)
    steady = time.perf_counter() - t1
    print(
        json.dumps(
            {
                "nodes": nodes,
                "gpus": nodes * 8,
                "pending": pending,
                "first_cycle_s": round(first, 3),
                "first_cycle_binds": len(plan.binds),
                "steady_cycle_s": round(steady, 3),
                "steady_cycle_binds": len(again.binds),
            }
        )
    )
    assert plan.binds and len(plan.binds) + len(plan.reasons) == pending
    assert not again.binds  # nothing more fits
