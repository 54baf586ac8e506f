"""The fast paths of `default` (score cache per node class, F0 memo, typicals grouped by device
shape) decide exactly what a straightforward computation decides.

The reference scores every node class afresh for every request with the per-typical
fragmentation (`frag_amount`, `frag_after_share`: one column per typical request, no grouping)
and the sigmoid written out, and keeps no memo. Both run the same seeded busy workload
(arrivals and departures, the pool held near 85% allocated).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from computepool.core import Request
from computepool.scheduler.filters import DeviceNeed
from computepool.scheduler.fragmentation import frag_after_share, frag_amount
from computepool.scheduler.pickers import first_fit
from computepool.scheduler.placement import Decision, Scheduler
from computepool.scheduler.policies import DefaultScorer, OnlineTypical
from computepool.scheduler.state import ClusterState
from computepool.scheduler.views import View
from computepool.sim.synthetic import synthetic_nodes, synthetic_requests


def _sigmoid(f0: np.ndarray, f1: np.ndarray, temperature: float) -> np.ndarray:
    return np.floor((1.0 / (1.0 + np.exp(-(f0 - f1) / temperature))) * 100.0)


class ReferenceDefault(DefaultScorer):
    """`default`'s rule computed the plain way (see the module docstring)."""

    def score(
        self, state: ClusterState, view: View, req: Request, need: DeviceNeed | None
    ) -> tuple[np.ndarray, np.ndarray]:
        assert need is not None
        typ = self.learner.typical
        acc = typ.access(state.models).T[view.gpu_model]  # (B, G, T)
        if req.fractional:
            f0, f1 = frag_after_share(view.cpu_free, view.gpu_free, acc, typ, req.cpu_milli, req.gpu_milli)
            s = np.where(need.usable, _sigmoid(f0[:, None], f1, self.temperature), -1.0)
            top = s.max(axis=1)
            best = np.argmax(np.where(s == top[:, None], f0[:, None] - f1, -np.inf), axis=1)
            return top, np.left_shift(np.int64(1), best.astype(np.int64))
        pick = first_fit(view, req, need)
        tiebreak = np.zeros(len(view))
        if req.gpu_count == 0:  # nodes with less idle GPU compute first (none idle, or no GPU: 0.5)
            for b in range(len(view)):
                tiebreak[b] = 0.5 / (1.0 + int(view.gpu_free[b].sum()) / 1000)
        left1 = view.gpu_free.copy()
        for b, mask in enumerate(pick.tolist()):
            for j in range(view.g):
                if mask >> j & 1:
                    left1[b, j] = 0
        f0 = frag_amount(view.cpu_free, view.gpu_free, acc, typ)
        f1 = frag_amount(view.cpu_free - req.cpu_milli, left1, acc, typ)
        return _sigmoid(f0, f1, self.whole_temperature) + tiebreak, pick


def _decisions(sched: Scheduler, n_nodes: int, n_requests: int, seed: int) -> list[object]:
    state = ClusterState.from_nodes(synthetic_nodes(n_nodes, 8, seed))
    cap = state.gpu_capacity_milli()
    live: deque[Decision] = deque()
    allocated = 0
    out: list[object] = []
    for req in synthetic_requests(n_requests, seed + 1):
        while live and allocated > 0.85 * cap:
            old = live.popleft()
            sched.release(state, old)
            allocated -= old.request.total_gpu_milli
        d = sched.schedule(state, req, explain=False)
        if d.ok:
            live.append(d)
            allocated += req.total_gpu_milli
            out.append([(p.node, p.devices, p.score) for p in d.placements])
        else:
            out.append(None)
    state.check_invariants()
    return out


@pytest.mark.parametrize("seed", [3, 11])
def test_default_decides_as_the_plain_computation(seed: int) -> None:
    # a short relearning period: the typical set moves often, so cached scores go stale often
    fast = Scheduler(DefaultScorer(OnlineTypical(period=256)))
    plain = Scheduler(ReferenceDefault(OnlineTypical(period=256)), cache=False)
    got = _decisions(fast, 60, 2500, seed)
    want = _decisions(plain, 60, 2500, seed)
    assert sum(d is None for d in got) < len(got) // 2  # a busy pool, not an empty or a stuck one
    assert got == want
