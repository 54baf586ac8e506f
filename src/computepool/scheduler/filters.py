"""Feasibility: which devices of a node a request could use, and why a node is rejected.

Filters run per node class (see state.py), vectorised over classes and devices. Each filter
that rejects a node names its reason; counted over the pool they answer "why is it pending".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from computepool.core.quantities import MILLI_PER_DEVICE, format_mib
from computepool.core.request import Request, Sharing
from computepool.scheduler.state import ClusterState, View, any_per_row


@dataclass
class DeviceNeed:
    """Per-device compute and memory a request needs on each device of each class, and usability."""

    milli: np.ndarray  # (B, G)
    memory: np.ndarray  # (B, G)
    allowed: np.ndarray  # (B, G) model allowed and device present
    usable: np.ndarray  # (B, G) allowed and enough free compute and memory


def allowed_models_mask(state: ClusterState, view: View, req: Request) -> np.ndarray:
    present = view.gpu_model >= 0
    if req.models is None:
        return present
    ids = np.array([state.model_id(m) for m in req.models], dtype=np.int64)
    return present & np.isin(view.gpu_model, ids)


def device_need(state: ClusterState, view: View, req: Request) -> DeviceNeed:
    allowed = allowed_models_mask(state, view, req)
    cap = view.gpu_cap
    mem_cap = view.gpu_mem_cap
    if req.gpu_milli >= MILLI_PER_DEVICE:
        milli = cap
        memory = mem_cap
        usable = allowed & (view.gpu_free == cap) & (view.gpu_mem_free == mem_cap) & (cap > 0)
    else:
        milli = np.full_like(cap, req.gpu_milli)
        if req.gpu_memory_mib is None:
            memory = (mem_cap * req.gpu_milli) // MILLI_PER_DEVICE
        else:
            memory = np.full_like(cap, req.gpu_memory_mib)
        usable = allowed & (view.gpu_free >= milli) & (view.gpu_mem_free >= memory)
    if req.sharing == Sharing.EXCLUSIVE:
        usable &= (view.gpu_free == cap) & (view.gpu_mem_free == mem_cap)
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
        ok &= need.usable.sum(axis=1) >= req.gpu_count
    return ok, need


def node_feasible(state: ClusterState, req: Request) -> np.ndarray:
    """Which nodes can hold `req`, with as few array operations as the request allows."""
    ok = (state.cpu_free >= req.cpu_milli) & (state.mem_free >= req.memory_mib) & state.schedulable
    k = req.gpu_count
    if k == 0:
        return ok
    if req.models is None and (req.gpu_milli >= MILLI_PER_DEVICE or req.sharing == Sharing.EXCLUSIVE):
        return ok & (state.idle_devices >= k)
    if req.models is None and req.fractional:
        if req.gpu_memory_mib is None:
            mem = (state.gpu_mem_cap * req.gpu_milli) // MILLI_PER_DEVICE
        else:
            mem = req.gpu_memory_mib
        dev = (state.gpu_free >= req.gpu_milli) & (state.gpu_mem_free >= mem)
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
    if k > 0:
        if req.models is not None:
            reject(need.allowed.sum(axis=1) == 0, "model not allowed")
        reject(need.allowed.sum(axis=1) < k, f"fewer than {k} GPUs")
    reject(view.cpu_free < req.cpu_milli, "CPU")
    reject(view.mem_free < req.memory_mib, "host memory")
    if k > 0:
        count = need.usable.sum(axis=1)
        if req.fractional:
            compute_ok = need.allowed & (view.gpu_free >= need.milli)
            reject(compute_ok.sum(axis=1) == 0, f"no GPU with {req.gpu_milli}m free")
            mem_label = (
                f"no GPU with {format_mib(req.gpu_memory_mib)} GPU memory free"
                if req.gpu_memory_mib
                else "no GPU with enough GPU memory free"
            )
            reject(count == 0, mem_label)
        else:
            what = "exclusive " if req.sharing == Sharing.EXCLUSIVE else ""
            noun = "GPU" if k == 1 else "GPUs"
            reject(count < k, f"no {k} {what}idle {noun}" if k > 1 else f"no {what}idle GPU")
    return Feasibility(ok=reason < 0, reason=reason, labels=labels, need=need)


@dataclass
class Reasons:
    """Why a request cannot be placed, counted over nodes: the "why is it pending" answer."""

    total_nodes: int
    counts: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        if not self.counts:
            text = f"{self.total_nodes} nodes: none rejected"
        else:
            parts = ", ".join(f"{n} {label}" for label, n in self.counts.most_common())
            text = f"{self.total_nodes} nodes: {parts}"
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
    cls = state.class_of[sched]
    if len(cls):
        uniq, inverse = np.unique(cls, return_inverse=True)
        feas = feasibility(state, state.class_view(uniq), req)
        per_node = feas.reason[inverse]
        for ix, n in zip(*np.unique(per_node[per_node >= 0], return_counts=True), strict=True):
            counts[feas.labels[int(ix)]] += int(n)
    if extra:
        counts.update(extra)
    return Reasons(total_nodes=state.n_nodes, counts=counts)
