"""Tenant quotas, borrowing and preemption victims: pure logic, no I/O and no clock.

Each tenant (a partition, a team, a virtual cluster) has a *guaranteed* quota and an optional
*limit*, in whole GPUs. Usage up to the guarantee is the tenant's own; usage above it is
*borrowed* from idle capacity and is the first (and only) thing taken back when a tenant still
within its guarantee needs GPUs. The Philly replay simulator (`sim/replay/`) calls this module;
callers pass times and snapshots (free GPUs per node, running jobs) and apply the decisions
themselves. The live pool applies the same rules to fractional, tiered and multi-resource
requests in `server/scheduling/decide.py`, with a ranking of its own; docs/architecture.md says
why the two differ.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Quota:
    """What a tenant is promised (`guarantee`) and the most it may hold (`limit`, None = pool)."""

    guarantee: int
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.guarantee < 0:
            raise ValueError(f"guarantee {self.guarantee} must be >= 0")
        if self.limit is not None and self.limit < self.guarantee:
            raise ValueError(f"limit {self.limit} is below guarantee {self.guarantee}")


@dataclass
class QuotaLedger:
    """GPUs held per tenant against its quota; the caller allocates and releases."""

    quotas: Mapping[str, Quota]
    usage: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for tenant in self.quotas:
            self.usage.setdefault(tenant, 0)
        unknown = set(self.usage) - set(self.quotas)
        if unknown:
            raise ValueError(f"usage for tenants without a quota: {sorted(unknown)}")

    def can_admit(self, tenant: str, gpus: int) -> bool:
        """True when `gpus` more stay within the tenant's limit."""
        limit = self.quotas[tenant].limit
        return limit is None or self.usage[tenant] + gpus <= limit

    def within_guarantee(self, tenant: str, gpus: int) -> bool:
        """True when `gpus` more stay within the guarantee (such a claim may preempt)."""
        return self.usage[tenant] + gpus <= self.quotas[tenant].guarantee

    def is_borrowing(self, tenant: str, gpus: int) -> bool:
        """True when admitting `gpus` more would take the tenant above its guarantee."""
        return not self.within_guarantee(tenant, gpus)

    def borrowed(self, tenant: str) -> int:
        """GPUs held above the guarantee: what others may reclaim."""
        return max(0, self.usage[tenant] - self.quotas[tenant].guarantee)

    def share(self, tenant: str) -> float:
        """Usage as a fraction of the guarantee; the lowest share is served first."""
        g = self.quotas[tenant].guarantee
        u = self.usage[tenant]
        if g == 0:
            return math.inf if u else 0.0
        return u / g

    def reclaimable(self, claimant: str | None = None, gpus: int = 0) -> dict[str, int]:
        """Per tenant, how many GPUs may be taken from it (never below its guarantee).

        Without a claimant: all borrowed GPUs. With one claiming `gpus` more, only what keeps
        each victim tenant's share at or above the claimant's share afterwards, so GPUs
        only ever move from a higher share to a lower one (no ping-pong). A claimant within
        its guarantee has a share of at most 1 afterwards, so it may take all borrowed GPUs.
        """
        if claimant is None:
            return {t: b for t in self.quotas if (b := self.borrowed(t)) > 0}
        g = self.quotas[claimant].guarantee
        after = (self.usage[claimant] + gpus) / g if g else math.inf
        out: dict[str, int] = {}
        for t, q in self.quotas.items():
            if t == claimant:
                continue
            keep = q.guarantee * after if after <= 1 else math.ceil(q.guarantee * after)
            b = min(self.borrowed(t), math.floor(self.usage[t] - max(keep, q.guarantee)))
            if b > 0:
                out[t] = b
        return out

    def allocate(self, tenant: str, gpus: int) -> None:
        self.usage[tenant] += gpus

    def release(self, tenant: str, gpus: int) -> None:
        if gpus > self.usage[tenant]:
            raise ValueError(f"{tenant} releases {gpus} GPUs but holds {self.usage[tenant]}")
        self.usage[tenant] -= gpus

    def order(self, demands: Mapping[str, int]) -> list[str]:
        """Serving order for tenants with a waiting head of `demands[t]` GPUs.

        Tenants whose head fits within their guarantee come first, then borrowers; each group
        by lowest share (ties by name, so the order is deterministic).
        """
        return sorted(
            demands,
            key=lambda t: (self.is_borrowing(t, demands[t]), self.share(t), t),
        )


def proportional_guarantees(sizes: Mapping[str, int], capacity: int) -> dict[str, int]:
    """Scale guarantees to fit `capacity` (largest remainder, so they sum to it exactly).

    When the sizes already fit, they are kept as they are (spare capacity is borrowable).
    """
    total = sum(sizes.values())
    if total <= capacity:
        return dict(sizes)
    exact = {t: s * capacity / total for t, s in sizes.items()}
    out = {t: math.floor(x) for t, x in exact.items()}
    left = capacity - sum(out.values())
    for t in sorted(exact, key=lambda t: (out[t] - exact[t], t))[:left]:
        out[t] += 1
    return out


@dataclass(frozen=True)
class Holding:
    """A running job as preemption sees it: its tenant, GPUs per node, and start time."""

    job: int
    tenant: str
    placement: tuple[tuple[int, int], ...]  # (node, gpus) pairs
    started_at: float
    gpus: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpus", sum(g for _, g in self.placement))

    def lost_work(self, now: float) -> float:
        """GPU-seconds thrown away if it is stopped now (it restarts from scratch)."""
        return self.gpus * max(0.0, now - self.started_at)


@dataclass(frozen=True)
class Claim:
    """A request for `nodes` distinct nodes with `gpus_per_node` free GPUs each."""

    tenant: str
    gpus_per_node: int
    nodes: int = 1


@dataclass(frozen=True)
class Preemption:
    """Victims to stop, and the nodes the claim takes once they are gone."""

    victims: tuple[Holding, ...]
    nodes: tuple[int, ...]
    lost_gpu_s: float


_LENT = "\0lent"  # the budget of jobs on the claimant's dedicated nodes (no tenant has this name)

# A candidate on one node: (work lost, -GPUs here, job, GPUs here, holding). Tuples sort by
# cost, then biggest first, then job id, so plans are deterministic and cheap to rank.
_Entry = tuple[float, int, int, int, Holding]


@dataclass(frozen=True)
class _NodePlan:
    node: int
    victims: tuple[Holding, ...]
    cost: float
    freed: int


def _plan_node(node: int, need: int, entries: list[_Entry], budgets: Mapping[str, int]) -> _NodePlan | None:
    """Cheapest victims on one node freeing `need` GPUs there (greedy, then pruned)."""
    entries.sort()
    left = dict(budgets)
    taken: list[_Entry] = []
    freed = 0
    for e in entries:
        h = e[4]
        if left[h.tenant] < h.gpus:
            continue
        left[h.tenant] -= h.gpus
        taken.append(e)
        freed += e[3]
        if freed >= need:
            break
    else:
        return None
    # Drop victims that turned out unnecessary, the costliest first.
    for e in sorted(taken, reverse=True):
        if freed - e[3] >= need:
            taken.remove(e)
            freed -= e[3]
    cost = sum(e[0] for e in taken)
    # A single victim may be cheaper than the greedy set.
    for e in entries:
        if e[3] >= need and budgets[e[4].tenant] >= e[4].gpus:
            if e[0] < cost:
                return _NodePlan(node, (e[4],), e[0], e[3])
            break
    return _NodePlan(node, tuple(e[4] for e in taken), cost, freed)


def select_victims(
    claim: Claim,
    free: Sequence[int],
    candidates: Iterable[Holding],
    budgets: Mapping[str, int],
    now: float,
    lent: Mapping[int, str] | None = None,
) -> Preemption | None:
    """Choose borrowed jobs to stop so that `claim` fits, losing as little work as possible.

    `free[n]` is the free GPUs of node n; `candidates` are running jobs that may be stopped;
    `budgets[t]` caps the GPUs taken from tenant t (use `QuotaLedger.reclaimable()`, so no
    tenant is pushed below its guarantee). Jobs of the claiming tenant are never victims.
    Victims are ranked by work lost (GPUs x time run: youngest, smallest first) and only as
    many as needed are taken; among nodes, the one losing least wins (then fewest GPUs
    freed, then fullest, then lowest index). Returns None when the claim cannot fit.

    `lent[job]` names the tenant whose dedicated node a job borrows: that job is borrowed
    capacity for its owner's claim whatever its tenant's quota says (outside `budgets`).
    """
    owed = {j for j, owner in (lent or {}).items() if owner == claim.tenant}
    if owed:  # count them against a budget of their own, as big as they are
        pool = list(candidates)
        back = {h.job: h for h in pool if h.job in owed and h.tenant != claim.tenant}
        budgets = {**budgets, _LENT: sum(h.gpus for h in back.values())}
        got = select_victims(
            claim, free, [replace(h, tenant=_LENT) if h.job in back else h for h in pool], budgets, now
        )
        if got is None:
            return None
        vs = tuple(back.get(h.job, h) for h in got.victims)
        return Preemption(vs, got.nodes, got.lost_gpu_s)
    want = claim.gpus_per_node
    by_node: dict[int, list[_Entry]] = {}
    for h in candidates:
        if h.tenant == claim.tenant or budgets.get(h.tenant, 0) < h.gpus:
            continue
        cost = h.gpus * max(0.0, now - h.started_at)
        for n, g in h.placement:
            if free[n] < want:
                by_node.setdefault(n, []).append((cost, -g, h.job, g, h))
    plans = [_NodePlan(n, (), 0.0, 0) for n, f in enumerate(free) if f >= want]
    if len(plans) < claim.nodes:
        # Visit nodes by a lower bound on their cost (their cheapest victim) and stop once
        # enough plans cost no more than the next bound: plans never get cheaper after that.
        bounds = sorted((min(e[0] for e in entries), n) for n, entries in by_node.items())
        costs: list[float] = []
        for bound, n in bounds:
            if len(costs) >= claim.nodes and sorted(costs)[claim.nodes - 1] < bound:
                break
            entries = by_node[n]
            need = want - free[n]
            if sum(e[3] for e in entries) < need:
                continue
            plan = _plan_node(n, need, entries, budgets)
            if plan is not None:
                plans.append(plan)
                costs.append(plan.cost)
    if len(plans) < claim.nodes:
        return None
    plans.sort(key=lambda p: (p.cost, p.freed, free[p.node], p.node))
    chosen: list[int] = []
    victims: dict[int, Holding] = {}
    spent: dict[str, int] = {}
    for p in plans:
        new = [h for h in p.victims if h.job not in victims]
        extra: dict[str, int] = {}
        for h in new:
            extra[h.tenant] = extra.get(h.tenant, 0) + h.gpus
        if any(spent.get(t, 0) + g > budgets[t] for t, g in extra.items()):
            continue
        for t, g in extra.items():
            spent[t] = spent.get(t, 0) + g
        victims.update((h.job, h) for h in new)
        chosen.append(p.node)
        if len(chosen) == claim.nodes:
            vs = tuple(sorted(victims.values(), key=lambda h: h.job))
            return Preemption(vs, tuple(chosen), sum(h.lost_work(now) for h in vs))
    return None
