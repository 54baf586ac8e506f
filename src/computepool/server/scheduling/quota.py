"""Requests, usage and quotas: what an allocation counts against its tenant's guarantee and limit.

Usage is keyed by (GPU model or "" for the whole pool, resource), in the pool's units
(milli-GPU, MiB, millicores). Everything here is arithmetic, no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from computepool.core import Request
from computepool.core.quantities import format_amount, resource_name

Key = tuple[str, str]  # (GPU model or "" for the whole pool, resource)
Usage = Counter[Key]
QuotaMap = dict[Key, tuple[int, int]]  # (guaranteed, limit)


def estimate(req: Request) -> Usage:
    """What a request will count against pool-wide quotas before it is placed (exact except
    for GPU memory in proportion to compute, counted once placed, and MIG-sized devices)."""
    u: Usage = Counter()
    n = req.gang_nodes
    if req.gpu_count:
        u[("", "gpu_milli")] = req.gpu_count * req.gpu_milli * n
        if req.gpu_memory_mib is not None and req.fractional:
            u[("", "gpu_memory_mib")] = req.gpu_memory_mib * n
    u[("", "cpu_milli")] = req.cpu_milli * n
    u[("", "memory_mib")] = req.memory_mib * n
    return u


def slices_usage(slices: Iterable[dict[str, Any]], model_of: Callable[[str, int], str | None]) -> Usage:
    """What bound slices count, pool-wide and per GPU model (`model_of(node, device index)`)."""
    u: Usage = Counter()
    for sl in slices:
        u[("", "gpu_milli")] += int(sl["compute_milli"])
        u[("", "gpu_memory_mib")] += int(sl["memory_mib"])
        model = model_of(sl["node"], int(sl["device_index"]))
        if model is not None:
            u[(model, "gpu_milli")] += int(sl["compute_milli"])
            u[(model, "gpu_memory_mib")] += int(sl["memory_mib"])
    return u


def host_usage(req: Request, nodes: int) -> Usage:
    """The CPU and host memory a request holds on `nodes` nodes."""
    return Counter({("", "cpu_milli"): req.cpu_milli * nodes, ("", "memory_mib"): req.memory_mib * nodes})


def over_limit(used: Usage, add: Usage, quota: QuotaMap) -> str | None:
    """The first limit `add` would break, in words; None when every limit holds."""
    for key in sorted(add):
        amount = add[key]
        if amount <= 0 or key not in quota:
            continue
        limit = quota[key][1]
        if used[key] + amount > limit:
            model, res = key
            return (
                f"quota: {resource_name(res, model)} limit {format_amount(res, limit)} "
                f"(using {format_amount(res, used[key])}, asks {format_amount(res, amount)})"
            )
    return None


def within_guarantee(used: Usage, add: Usage, quota: QuotaMap) -> bool:
    """True when everything `add` asks for of the resources the tenant has a quota for stays within
    what it is guaranteed. The others do not count: every request carries CPU and memory (its own
    or its tenant's defaults), and a guarantee of GPUs alone must still let it reclaim them."""
    asked = [k for k, v in add.items() if v > 0 and k in quota]
    return bool(asked) and all(used[k] + add[k] <= quota.get(k, (0, 0))[0] for k in asked)


def reclaimable(used: Usage, victim: Usage, quota: QuotaMap) -> bool:
    """May `victim` be taken from its tenant? Only if it keeps the tenant at or above its guarantee."""
    return all(used[k] - v >= quota.get(k, (0, 0))[0] for k, v in victim.items() if v > 0)
