"""Feasibility: which devices of a node a request could use, and why a node is rejected.

Filters run per node class (see state.py), vectorised over classes and devices. Each filter
that rejects a node names its reason; counted over the pool they answer "why is it pending".

Tier rules: a device holds slices of one tier at a time (timeslice with timeslice, mps with
mps of the same tenant, an exclusive slice alone); `mig` requests go only to MIG instances, each
taken whole, and every other request only to whole GPUs. A device taken whole gives at least the
memory asked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from computepool.core.allocation import Isolation
from computepool.core.quantities import MILLI_PER_DEVICE, format_mib
from computepool.core.request import Request, Sharing
from computepool.core.resources import mig_base_model
from computepool.core.vendors import tiers_of, vendor
from computepool.scheduler.constraints import LABELS, OK, NodeConstraints, NodeRules
from computepool.scheduler.state import (
    TIER_MPS,
    TIER_NAME,
    TIER_NONE,
    TIER_TIMESLICE,
    ClusterState,
    tier_code,
)
from computepool.scheduler.views import View, any_per_row


@dataclass
class DeviceNeed:
    """Per-device compute and memory a request needs on each device of each class, and usability."""

    milli: np.ndarray  # (B, G)
    memory: np.ndarray  # (B, G)
    allowed: np.ndarray  # (B, G) device present, of the right kind (MIG or not), model allowed
    usable: np.ndarray  # (B, G) allowed and enough free compute and memory


def _vendor_of(state: ClusterState, model_id: int) -> str:
    vendors = state.model_vendor
    return vendors[model_id] if model_id < len(vendors) else "nvidia"  # a state built without them


def model_ids(state: ClusterState, req: Request, *, vendors: bool = True, models: bool = True,
              tiers: bool = True) -> np.ndarray | None:  # fmt: skip
    """Ids of the device models `req` may use: of its vendors, its models (a MIG instance also by
    its GPU's model) and whose vendor enforces its tier. None: every model (the common case,
    answered without a look at the models)."""
    tier = req.tier
    want_vendors = req.vendors if vendors else None
    want_models = req.models if models else None
    check_tier = tiers and tier is not None and tier != Isolation.EXCLUSIVE
    if want_vendors is None and want_models is None and not check_tier:
        return None
    ids = []
    for i, m in enumerate(state.models):
        v = _vendor_of(state, i)
        if want_vendors is not None and v not in want_vendors:
            continue
        mig_of_model = tier == Isolation.MIG and mig_base_model(m) in (want_models or ())
        if want_models is not None and m not in want_models and not mig_of_model:
            continue
        if check_tier and tier not in tiers_of(v):
            continue
        ids.append(i)
    if len(ids) == len(state.models):
        return None
    return np.array(ids, dtype=np.int64)


def _of_models(view: View, ids: np.ndarray | None) -> np.ndarray:
    present = view.gpu_model >= 0
    return present if ids is None else present & np.isin(view.gpu_model, ids)


def allowed_models_mask(state: ClusterState, view: View, req: Request) -> np.ndarray:
    """Devices present, of an allowed vendor and model, whose vendor enforces the request's tier,
    and at least as big as it asks (`min_gpu_memory_mib`)."""
    ok = _of_models(view, model_ids(state, req))
    if req.min_gpu_memory_mib:
        ok = ok & (view.gpu_mem_cap >= req.min_gpu_memory_mib)
    return ok


def plain_devices(state: ClusterState, req: Request) -> bool:
    """Any device will do as far as its kind goes (no vendor, model, size or tier rule narrows)."""
    return not req.min_gpu_memory_mib and model_ids(state, req) is None


def kind_mask(state: ClusterState, view: View, req: Request) -> np.ndarray:
    """`mig` requests: MIG instances (of their profile, if named); any other: whole GPUs only."""
    if req.tier != Isolation.MIG:
        return view.gpu_profile < 0
    if req.mig_profile is None:
        return view.gpu_profile >= 0
    return view.gpu_profile == state.profile_id(req.mig_profile)


def whole_fit(view: View, req: Request) -> np.ndarray:
    """Devices big enough to be taken whole by `req`: the memory it asks, and the share for `mig`."""
    ok = view.gpu_cap > 0
    if req.gpu_memory_mib:
        ok = ok & (view.gpu_mem_cap >= req.gpu_memory_mib)
    if req.gpu_milli < MILLI_PER_DEVICE:  # a `mig` request for an instance of at least this share
        ok = ok & (view.gpu_cap >= req.gpu_milli)
    return ok


def device_need(state: ClusterState, view: View, req: Request) -> DeviceNeed:
    if req.tier != Isolation.MIG and not state.profiles:  # no MIG instance anywhere: any device kind fits
        allowed = allowed_models_mask(state, view, req)
    else:
        allowed = allowed_models_mask(state, view, req) & kind_mask(state, view, req)
    cap = view.gpu_cap
    mem_cap = view.gpu_mem_cap
    if req.whole_devices:
        milli = cap
        memory = mem_cap
        idle = (view.gpu_free == cap) & (view.gpu_mem_free == mem_cap) & (view.gpu_tier == TIER_NONE)
        usable = allowed & idle & whole_fit(view, req)
    else:
        milli = np.full_like(cap, req.gpu_milli)
        if req.gpu_memory_mib is None:
            memory = (mem_cap * req.gpu_milli) // MILLI_PER_DEVICE
        else:
            memory = np.full_like(cap, req.gpu_memory_mib)
        tier, t = view.gpu_tier, tier_code(req)
        if t == TIER_MPS:  # one tenant's mps slices per device (one MPS server, one Unix user)
            same_tier = (tier == TIER_NONE) | ((tier == t) & (view.gpu_owner == state.owner_id(req.tenant)))
        elif t == TIER_TIMESLICE:  # the lowest tier code: one comparison says "none or timeslice"
            same_tier = tier <= t
        else:
            same_tier = (tier == TIER_NONE) | (tier == t)
        usable = allowed & (view.gpu_free >= milli) & (view.gpu_mem_free >= memory) & same_tier
    return DeviceNeed(milli=milli, memory=memory, allowed=allowed, usable=usable)


@dataclass
class Feasibility:
    """Per class: feasible or not, and the first reason for rejecting it."""

    ok: np.ndarray  # (B,) bool
    reason: np.ndarray  # (B,) int index into `labels`, -1 when feasible
    labels: list[str]
    need: DeviceNeed


def feasible(
    state: ClusterState, view: View, req: Request, *, host_memory: bool = True
) -> tuple[np.ndarray, DeviceNeed]:
    """The hot path: which classes can hold `req` (no reasons; see `feasibility` for those)."""
    need = device_need(state, view, req)
    ok = view.cpu_free >= req.cpu_milli
    if host_memory:
        ok &= view.mem_free >= req.memory_mib
    if req.gpu_count > 0:
        ok &= np.add.reduce(need.usable, axis=1) >= req.gpu_count
    return ok, need


def node_feasible(state: ClusterState, req: Request) -> np.ndarray:
    """Which nodes can hold `req`, with as few array operations as the request allows."""
    ok = (state.cpu_free >= req.cpu_milli) & (state.mem_free >= req.memory_mib) & state.eligible(req)
    k = req.gpu_count
    if k == 0:
        return ok
    plain = plain_devices(state, req)
    if plain and req.whole_devices and req.tier != Isolation.MIG and not req.gpu_memory_mib:
        return ok & (state.idle_devices >= k)  # idle whole GPUs
    if plain and req.fractional:
        mem: np.ndarray | int
        if req.gpu_memory_mib is None:
            mem = (state.gpu_mem_cap * req.gpu_milli) // MILLI_PER_DEVICE
        else:
            mem = req.gpu_memory_mib
        dev = (state.gpu_free >= req.gpu_milli) & (state.gpu_mem_free >= mem)
        t, lock = tier_code(req), state.gpu_lock  # a whole GPU free of other tiers
        if t == TIER_TIMESLICE:
            dev &= lock <= t
        elif t == TIER_MPS:  # and of other tenants' mps slices
            dev &= (lock == TIER_NONE) | ((lock == t) & (state.gpu_owner == state.owner_id(req.tenant)))
        else:
            dev &= (lock == TIER_NONE) | (lock == t)
        return ok & any_per_row(dev)
    need = device_need(state, state.node_view(), req)
    return ok & (need.usable.sum(axis=1) >= k)


def feasibility(state: ClusterState, view: View, req: Request) -> Feasibility:
    """Run the filter chain over classes: models, CPU, host memory, devices (in that order)."""
    b = len(view)
    reason = np.full(b, -1, dtype=np.int64)
    labels: list[str] = []
    need = device_need(state, view, req)

    def reject(mask: np.ndarray, label: str) -> None:
        hit = mask & (reason < 0)
        if hit.any():
            labels.append(label)
            reason[hit] = len(labels) - 1

    k = req.gpu_count
    mig = req.tier == Isolation.MIG
    if k > 0:
        _reject_kinds(state, view, req, reject)
        models_ok = allowed_models_mask(state, view, req)
        if mig:
            reject(need.allowed.sum(axis=1) < k, f"no MIG instance {req.mig_profile or ''}".rstrip())
        else:
            on_mig = (models_ok & (view.gpu_profile >= 0)).sum(axis=1) > 0
            reject(on_mig & (need.allowed.sum(axis=1) < k), "GPUs split into MIG instances (ask with mig)")
        reject(need.allowed.sum(axis=1) < k, f"fewer than {k} GPU{'' if k == 1 else 's'}")
    reject(view.cpu_free < req.cpu_milli, "CPU")
    reject(view.mem_free < req.memory_mib, "host memory")
    if k > 0:
        _reject_devices(view, req, need, reject)
    return Feasibility(ok=reason < 0, reason=reason, labels=labels, need=need)


def _reject_kinds(
    state: ClusterState, view: View, req: Request, reject: Callable[[np.ndarray, str], None]
) -> None:
    """Vendor, model, tier and size, in that order: each names what the node lacks."""
    if req.vendors is not None:
        ok = _of_models(view, model_ids(state, req, models=False, tiers=False))
        names = " or ".join(vendor(v).title for v in sorted(req.vendors))
        reject(ok.sum(axis=1) == 0, f"no {names} device")
    if req.models is not None:
        ok = _of_models(view, model_ids(state, req, tiers=False))
        reject(ok.sum(axis=1) == 0, "model not allowed")
    tier = req.tier
    if tier is not None and tier != Isolation.EXCLUSIVE:
        ok = _of_models(view, model_ids(state, req))
        rest = _of_models(view, model_ids(state, req, tiers=False)) & ~ok
        none = ok.sum(axis=1) == 0
        for v in sorted({_vendor_of(state, int(m)) for m in np.unique(view.gpu_model[rest])}):
            of_v = np.array(
                [i for i in range(len(state.models)) if _vendor_of(state, i) == v], dtype=np.int64
            )
            held = (rest & np.isin(view.gpu_model, of_v)).any(axis=1)
            reject(none & held, f"{vendor(v).title} devices cannot enforce {tier.value}")
    if req.min_gpu_memory_mib:
        ok = allowed_models_mask(state, view, req)
        reject(ok.sum(axis=1) == 0, f"no device with {format_mib(req.min_gpu_memory_mib)} GPU memory")


def _reject_devices(
    view: View, req: Request, need: DeviceNeed, reject: Callable[[np.ndarray, str], None]
) -> None:
    """The device filters: size, free capacity, then the tier the devices hold."""
    k = req.gpu_count
    count = need.usable.sum(axis=1)
    noun = "MIG instance" if req.tier == Isolation.MIG else "GPU"
    if req.whole_devices:
        big = need.allowed & whole_fit(view, req)
        if req.gpu_memory_mib:
            reject(big.sum(axis=1) < k, f"no {noun} with {format_mib(req.gpu_memory_mib)} GPU memory")
        if req.gpu_milli < MILLI_PER_DEVICE:
            reject(big.sum(axis=1) < k, f"no {noun} with {req.gpu_milli}m compute")
        what = "exclusive " if req.sharing == Sharing.EXCLUSIVE and req.tier != Isolation.MIG else ""
        plural = noun + ("s" if k > 1 else "")
        reject(count < k, f"no {k} {what}idle {plural}" if k > 1 else f"no {what}idle {noun}")
        return
    compute_ok = need.allowed & (view.gpu_free >= need.milli)
    reject(compute_ok.sum(axis=1) == 0, f"no GPU with {req.gpu_milli}m free")
    fits = compute_ok & (view.gpu_mem_free >= need.memory)
    mem_label = (
        f"no GPU with {format_mib(req.gpu_memory_mib)} GPU memory free"
        if req.gpu_memory_mib
        else "no GPU with enough GPU memory free"
    )
    reject(fits.sum(axis=1) == 0, mem_label)
    # room enough, but every such device holds slices of another tier (or another tenant's mps
    # slices): name the first one
    blocked = fits & ~need.usable
    rows = np.flatnonzero((count == 0) & blocked.any(axis=1))
    if len(rows):
        first = np.argmax(blocked[rows], axis=1)
        tiers = view.gpu_tier[rows, first]
        for j, t in sorted(set(zip(first.tolist(), tiers.tolist(), strict=True))):
            hit = np.zeros(len(count), dtype=bool)
            hit[rows[(first == j) & (tiers == t)]] = True
            if t == TIER_MPS and req.tier == Isolation.MPS:
                reject(hit, f"device {j} holds another tenant's mps slices")
            else:
                reject(hit, f"device {j} holds {TIER_NAME.get(t, 'other')} slices")


@dataclass
class Reasons:
    """Why a request cannot be placed, counted over nodes: the "why is it pending" answer."""

    total_nodes: int
    counts: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        nodes = f"{self.total_nodes} node{'' if self.total_nodes == 1 else 's'}"
        if not self.counts:
            text = f"{nodes}: none rejected"
        else:
            parts = ", ".join(f"{n} {label}" for label, n in self.counts.most_common())
            text = f"{nodes}: {parts}"
        return "; ".join([text, *self.notes])

    def to_dict(self) -> dict[str, object]:
        return {
            "total_nodes": self.total_nodes,
            "counts": dict(self.counts.most_common()),
            "notes": list(self.notes),
            "summary": str(self),
        }


def explain(state: ClusterState, req: Request, extra: Counter[str] | None = None) -> Reasons:
    """Count, over every node, the first filter that rejects it."""
    counts: Counter[str] = Counter()
    sched = state.schedulable
    n_off = int((~sched).sum())
    if n_off:
        counts["not schedulable"] = n_off
    notes: list[str] = []
    rules = state.rules
    if rules is None and (req.node_selector or req.stacks):
        rules = NodeConstraints([NodeRules()] * state.n_nodes)
    if rules is not None:  # node rules next: selector, taints, dedication (constraints.py)
        code = rules.rejections(req)
        for c, label in LABELS.items():
            n_rule = int((sched & (code == c)).sum())
            if n_rule:
                counts[label] = n_rule
        notes = rules.notes(req, np.where(sched, code, OK))
        sched = sched & (code == OK)
    cls = state.class_of[sched]
    if len(cls):
        uniq, inverse = np.unique(cls, return_inverse=True)
        feas = feasibility(state, state.class_view(uniq), req)
        per_node = feas.reason[inverse]
        for ix, n in zip(*np.unique(per_node[per_node >= 0], return_counts=True), strict=True):
            counts[feas.labels[int(ix)]] += int(n)
    if extra:
        counts.update(extra)
    return Reasons(total_nodes=state.n_nodes, counts=counts, notes=notes)
