"""Scoring policies: the six published in the FGD study, and the pool's own `default`.

Each scorer maps feasible node classes to a score (higher wins; ties go to the lowest node
index) and a device choice. The published ones follow the reference simulator: whole-number
scores 0–100, truncated, which is why ties are common and the tie-break matters.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from computepool.core.quantities import MILLI_PER_DEVICE
from computepool.core.request import Request
from computepool.scheduler import policy_names
from computepool.scheduler.filters import DeviceNeed
from computepool.scheduler.fragmentation import (
    TypicalKey,
    TypicalPods,
    frag_after_share_grouped,
    frag_amount_grouped,
    sigmoid_score,
    typical_key,
)
from computepool.scheduler.pickers import best_fit, first_fit, random_fit
from computepool.scheduler.placement import Scorer
from computepool.scheduler.state import TAG_CPU_ONLY, ClusterState, tag_of
from computepool.scheduler.views import View

Scores = tuple[np.ndarray, np.ndarray | None]  # per-row scores, device bitmasks or None (`Scorer`)
MAX_SPEC_CPU = 128_000.0  # normalisers of the published dotprod / bestfit scores
MAX_SPEC_GPU = 8_000.0


def _gpu_request(req: Request) -> int:
    return req.gpu_milli * req.gpu_count


class _Static:
    """Cheap scorers that learn nothing: scored straight over all nodes; devices best fit."""

    node_local = True
    cheap = True
    random_node = False
    device_choice = "best"
    rng: np.random.Generator | None = None

    def epoch(self) -> int:
        return 0

    def observe(self, req: Request) -> None:
        return None

    def pick(self, view: View, req: Request, need: DeviceNeed) -> np.ndarray:
        return best_fit(view, req, need)


class RandomScorer:
    """`random`: one random feasible node, a random fitting device."""

    name = "random"
    node_local = False
    cheap = True
    random_node = True
    device_choice = "random"

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def epoch(self) -> int:
        return 0

    def observe(self, req: Request) -> None:
        return None

    def score(self, state: ClusterState, view: View, req: Request, need: DeviceNeed | None) -> Scores:
        return np.zeros(len(view)), None

    def pick(self, view: View, req: Request, need: DeviceNeed) -> np.ndarray:
        return random_fit(view, req, need, self.rng)


class FirstFitScorer(_Static):
    """`firstfit`: the lowest-index feasible node (used by the offline reference packer)."""

    name = "firstfit"

    def score(self, state: ClusterState, view: View, req: Request, need: DeviceNeed | None) -> Scores:
        return np.zeros(len(view)), None


class DotProdScorer(_Static):
    """`dotprod`: smallest dot product of normalised free and requested (CPU, GPU) wins."""

    name = "dotprod"

    def score(self, state: ClusterState, view: View, req: Request, need: DeviceNeed | None) -> Scores:
        gpu_left = view.gpu_left
        dot = (view.cpu_free / MAX_SPEC_CPU) * (req.cpu_milli / MAX_SPEC_CPU) + (gpu_left / MAX_SPEC_GPU) * (
            _gpu_request(req) / MAX_SPEC_GPU
        )
        s = np.floor(100.0 * (1.0 - dot / 2.0))
        return s, None


class ClusteringScorer(_Static):
    """`clustering`: nodes already hosting only this kind of work, then empty nodes; fuller first."""

    name = "clustering"

    def score(self, state: ClusterState, view: View, req: Request, need: DeviceNeed | None) -> Scores:
        b = len(view)
        if req.gpu_count == 0:
            return np.zeros(b), None
        gpu_left = view.gpu_left
        base = (25 * (8000 - gpu_left)) // 8000
        bit = np.int64(1) << np.int64(tag_of(req.gpu_count, req.fractional))
        gpu_tags = view.kinds & ~(np.int64(1) << np.int64(TAG_CPU_ONLY))
        has = (gpu_tags & bit) != 0
        only = has & (gpu_tags == bit)
        offset = np.where(only, 75, np.where(has, 50, np.where(gpu_tags == 0, 25, 0)))
        return (base + offset).astype(np.float64), None


class PackingScorer(_Static):
    """`packing`: partially used devices first, then used nodes with idle devices, then idle nodes."""

    name = "packing"

    def score(self, state: ClusterState, view: View, req: Request, need: DeviceNeed | None) -> Scores:
        b = len(view)
        if req.gpu_count == 0:
            return np.zeros(b), None
        present = view.gpu_cap > 0
        full_free = present & (view.gpu_free == view.gpu_cap)
        n_present = present.sum(axis=1)
        n_free = full_free.sum(axis=1)
        all_free = n_free == n_present
        case3 = np.maximum(33 - n_free, n_free)
        # the devices best fit would take: ascending free, fitting ones, first k
        fits = view.gpu_free >= (MILLI_PER_DEVICE if req.gpu_milli >= MILLI_PER_DEVICE else req.gpu_milli)
        key = np.where(present & fits, view.gpu_free, np.iinfo(np.int64).max // 4)
        order = np.argsort(key, axis=1, kind="stable")[:, : req.gpu_count]
        taken_left = np.take_along_axis(view.gpu_free, order, axis=1)
        taken_full = np.take_along_axis(full_free, order, axis=1)
        k_free = taken_full.sum(axis=1)
        case2 = np.maximum(50 - k_free, 33)
        case1 = np.maximum(100 - ((taken_left * 100 // 1000).sum(axis=1)) // 10, 50)
        s = np.where(all_free, case3, np.where(k_free > 0, case2, case1))
        return s.astype(np.float64), None


class BestFitScorer(_Static):
    """`bestfit`: the node left with the least free (CPU, GPU), normalised by (128 cores, 8 GPUs)."""

    name = "bestfit"

    def score(self, state: ClusterState, view: View, req: Request, need: DeviceNeed | None) -> Scores:
        gpu_left = view.gpu_left
        s = (
            0.5 * (view.cpu_free - req.cpu_milli) / MAX_SPEC_CPU
            + 0.5 * (gpu_left - _gpu_request(req)) / MAX_SPEC_GPU
        )
        return np.floor((1.0 - s) * 100.0), None


def _access(state: ClusterState, view: View, typ: TypicalPods) -> np.ndarray:
    """(B, G, D): device g of class b may host typicals of group d (model allowed, device present)."""
    return typ.group_access(state.models)[view.gpu_model]  # row -1 of the table: no device


def fgd_scores(
    state: ClusterState,
    view: View,
    req: Request,
    need: DeviceNeed,
    typ: TypicalPods,
    temperature: float = 1000.0,
    fine_devices: bool = False,
    whole_temperature: float = 1000.0,
) -> tuple[np.ndarray, np.ndarray]:
    """FGD's whole-number score 100·sigmoid((F0 − F1)/temperature) and the device choice.

    For a fractional request every fitting device is tried; the best whole-number score wins
    and, among devices tied on it, the first (as published) or, with `fine_devices`, the one
    whose exact fragmentation change is smallest.
    """
    acc = _access(state, view, typ)
    cpu_free, left = view.cpu_free, view.gpu_free
    if req.fractional:
        f0, f1 = frag_after_share_grouped(cpu_free, left, acc, typ, req.cpu_milli, req.gpu_milli)
        if fine_devices:
            # the score is non-decreasing in F0 − F1, so the device with the largest exact change
            # (the first on ties) also has the top whole-number score: score that one device only
            best = np.argmax(np.where(need.usable, f0[:, None] - f1, -np.inf), axis=1)
            top = sigmoid_score(f0, f1[np.arange(len(best)), best], temperature)
        else:
            s = np.where(need.usable, sigmoid_score(f0[:, None], f1, temperature), -1.0)
            top = s.max(axis=1)
            best = np.argmax(s, axis=1)
        return top, np.left_shift(np.int64(1), best)
    pick = first_fit(view, req, need)
    # before and after as one stacked batch (2, B, …): the same per-row sums in half the steps
    left01 = np.stack((left, left))
    if req.gpu_count:
        left01[1][((pick[:, None] >> np.arange(view.g, dtype=np.int64)) & 1).astype(bool)] = 0
    f01 = frag_amount_grouped(np.stack((cpu_free, cpu_free - req.cpu_milli)), left01, acc, typ)
    return sigmoid_score(f01[0], f01[1], whole_temperature), pick


class FGDScorer(_Static):
    """`fgd` as published: the placement that adds the least fragmentation wins.

    Uses future knowledge: the typical-request distribution is taken from the whole workload
    before the run starts.
    """

    name = "fgd"
    cheap = False

    def __init__(self, typical: TypicalPods) -> None:
        self.typical = typical

    def score(self, state: ClusterState, view: View, req: Request, need: DeviceNeed | None) -> Scores:
        assert need is not None
        return fgd_scores(state, view, req, need, self.typical)


@dataclass
class OnlineTypical:
    """The typical-request distribution learned from the requests seen so far (no future).

    The typical set is rebuilt after 1, 2, 4, … requests and then every `period`; the
    epoch moves (invalidating cached scores) only when the rebuilt set differs in shape or
    its weights moved by more than `tolerance` in total variation.
    """

    coverage: float = 0.95
    period: int = 1024
    tolerance: float = 0.02
    counts: Counter[TypicalKey] = field(default_factory=Counter)
    seen: int = 0
    epoch: int = 0
    typical: TypicalPods = field(default_factory=lambda: TypicalPods.from_counts(Counter()))
    _next: int = 1

    def observe(self, req: Request) -> None:
        self.counts[typical_key(req)] += 1
        self.seen += 1
        if self.seen >= self._next:
            self._next = self.seen * 2 if self.seen < self.period else self.seen + self.period
            new = TypicalPods.from_counts(self.counts, self.coverage)
            if self._moved(new):
                self.typical = new
                self.epoch += 1

    def _moved(self, new: TypicalPods) -> bool:
        old = self.typical
        if old.size != new.size:
            return True
        ok = {
            (int(c), int(m), int(k), md): w
            for c, m, k, md, w in zip(old.cpu, old.milli, old.count, old.models, old.weight, strict=True)
        }
        tv = 0.0
        for c, m, k, md, w in zip(new.cpu, new.milli, new.count, new.models, new.weight, strict=True):
            prev = ok.pop((int(c), int(m), int(k), md), None)
            if prev is None:
                return True
            tv += abs(prev - w)
        return tv / 2 > self.tolerance


class DefaultScorer:
    """`default`, the pool's policy: fragmentation gradient descent without future knowledge.

    - The typical-request distribution is learned online from the requests seen so far.
    - For fractional requests the score is FGD's whole-number sigmoid at a four times softer
      temperature (4000 rather than 1000 milli): placements whose fragmentation change differs
      by less than about a sixth of a GPU land in one tie class, and ties go to the lowest node
      index, i.e. work is packed onto the earliest nodes of a fixed order. The coarser classes
      make the choice robust to the noise of a distribution estimated from few requests, and
      pack tighter. Whole-device and CPU-only requests keep FGD's temperature: softening it
      there measured worse (4.83% vs 4.67% unallocated on the default workload, seeds 42–44).
    - Inside the chosen node, among devices tied on the score, the one adding the least
      fragmentation (exact change) wins.
    - CPU-only requests: among nodes tied on the whole-number score, those with the least idle
      GPU compute win (a node without GPUs, or with every GPU taken, first), before the lowest
      index (`idle_gpu_tiebreak`). FGD leaves nearly all of them tied (taking CPU from a node
      changes its fragmentation only once a typical GPU request no longer fits), so CPU-only
      work filled the CPUs of the earliest nodes whatever their GPUs held; the CPUs of nodes
      with idle GPUs are kept for the GPU work that will need them, the more idle GPUs the
      longer. Counted in devices rather than as a share of the node's: a node with one idle GPU
      gives its CPU before a node with four (of eight) idle, which strands more if its CPU
      runs out. On cpu100 with its CPU-only pods ×2.5 (seeds 42–51) the share left 5.25%
      unallocated, the idle amount 5.02%, without a tie-break 5.54% (seeds 42–46).
    """

    name = "default"
    node_local = True
    cheap = False
    random_node = False
    device_choice = "best"
    rng: np.random.Generator | None = None
    temperature = 4000.0
    whole_temperature = 1000.0

    def __init__(self, learner: OnlineTypical | None = None) -> None:
        self.learner = learner or OnlineTypical()

    def epoch(self) -> int:
        return self.learner.epoch

    def observe(self, req: Request) -> None:
        self.learner.observe(req)

    def score(self, state: ClusterState, view: View, req: Request, need: DeviceNeed | None) -> Scores:
        assert need is not None
        s, pick = fgd_scores(
            state,
            view,
            req,
            need,
            self.learner.typical,
            self.temperature,
            fine_devices=True,
            whole_temperature=self.whole_temperature,
        )
        if req.gpu_count == 0:
            s = s + idle_gpu_tiebreak(view)
        return s, pick

    def pick(self, view: View, req: Request, need: DeviceNeed) -> np.ndarray:
        return first_fit(view, req, need)


def idle_gpu_tiebreak(view: View) -> np.ndarray:
    """Per row, in (0, 0.5]: 0.5 / (1 + the node's idle GPU compute in devices); 0.5 with none idle.

    Added to whole-number scores it orders only nodes tied on them: the less idle GPU, the earlier.
    """
    return 0.5 / (1.0 + view.gpu_left / MILLI_PER_DEVICE)


POLICIES = policy_names.POLICIES  # also readable without numpy (the CLI's help)


def make_scorer(name: str, *, seed: int = 0, typical: TypicalPods | None = None) -> Scorer:
    """Build a scorer by name. `fgd` needs the workload's typical requests (future knowledge)."""
    if name == "random":
        return RandomScorer(np.random.default_rng(seed))
    if name == "dotprod":
        return DotProdScorer()
    if name == "clustering":
        return ClusteringScorer()
    if name == "packing":
        return PackingScorer()
    if name == "bestfit":
        return BestFitScorer()
    if name == "firstfit":
        return FirstFitScorer()
    if name == "fgd":
        if typical is None:
            raise ValueError("fgd needs the workload's typical requests")
        return FGDScorer(typical)
    if name == "default":
        return DefaultScorer()
    raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
