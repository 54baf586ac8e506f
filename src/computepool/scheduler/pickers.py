"""Device pickers: which devices of the chosen node a request takes (as a bitmask per class)."""

from __future__ import annotations

import numpy as np

from computepool.core.allocation import Isolation
from computepool.core.quantities import MILLI_PER_DEVICE
from computepool.core.request import Request
from computepool.scheduler.filters import DeviceNeed, model_ids
from computepool.scheduler.state import LOCK_MIG, TIER_MPS, TIER_NONE, ClusterState, tier_code
from computepool.scheduler.views import View

_BIG = np.iinfo(np.int64).max // 4


def _first_k_mask(order_key: np.ndarray, usable: np.ndarray, k: int) -> np.ndarray:
    """Bitmask of the k usable devices with the smallest key (stable: lower index first)."""
    key = np.where(usable, order_key, _BIG)
    order = np.argsort(key, axis=1, kind="stable")[:, :k]
    bits = np.left_shift(np.int64(1), order.astype(np.int64))
    return bits.sum(axis=1).astype(np.int64)


def best_fit(view: View, req: Request, need: DeviceNeed) -> np.ndarray:
    """The usable devices with the least free compute (then memory), lowest index first."""
    if req.gpu_count == 0:
        return np.zeros(len(view), dtype=np.int64)
    key = view.gpu_free * (1 << 24) + np.minimum(view.gpu_mem_free, (1 << 24) - 1)
    return _first_k_mask(key, need.usable, req.gpu_count)


def first_fit(view: View, req: Request, need: DeviceNeed) -> np.ndarray:
    """The lowest-index usable devices."""
    if req.gpu_count == 0:
        return np.zeros(len(view), dtype=np.int64)
    g = view.gpu_free.shape[1]
    key = np.broadcast_to(np.arange(g, dtype=np.int64), view.gpu_free.shape)
    return _first_k_mask(key, need.usable, req.gpu_count)


def random_fit(view: View, req: Request, need: DeviceNeed, rng: np.random.Generator) -> np.ndarray:
    """Random usable devices."""
    if req.gpu_count == 0:
        return np.zeros(len(view), dtype=np.int64)
    key = rng.random(view.gpu_free.shape)
    return _first_k_mask(key, need.usable, req.gpu_count)


def mask_to_devices(mask: int) -> list[int]:
    out = []
    j = 0
    while mask:
        if mask & 1:
            out.append(j)
        mask >>= 1
        j += 1
    return out


def pick_on_node(
    state: ClusterState, node: int, req: Request, how: str = "best", rng: np.random.Generator | None = None
) -> int:
    """Device bitmask for `req` on one node, in plain Python (a node has a handful of devices).

    how: "best" (least free compute, then memory, lowest index), "first", or "random". The
    same rules as `filters.device_need`: kind (MIG or not), tier (and the mps owner), whole-device size.
    """
    k = req.gpu_count
    if k == 0:
        return 0
    free = state.gpu_free[node].tolist()
    mem_free = state.gpu_mem_free[node].tolist()
    cap = state.gpu_cap[node].tolist()
    mem_cap = state.gpu_mem_cap[node].tolist()
    model = state.gpu_model[node].tolist()
    mig = req.tier == Isolation.MIG
    # whole GPUs: gpu_lock is their tier; MIG instances (only for `mig`): profile and tier
    lock = state.gpu_lock[node].tolist()
    profile = state.gpu_profile[node].tolist() if mig else lock
    tier = state.gpu_tier[node].tolist() if mig else lock
    ids = model_ids(state, req)  # vendor, model, and a vendor that enforces the tier
    allowed_ids = None if ids is None else set(ids.tolist())
    floor = req.min_gpu_memory_mib
    want_profile = state.profile_id(req.mig_profile) if req.mig_profile is not None else None
    whole = req.whole_devices
    my_tier = tier_code(req)
    owner = state.gpu_owner[node].tolist() if my_tier == TIER_MPS else None
    me = state.owner_id(req.tenant)
    usable = []
    for j in range(len(free)):
        if cap[j] <= 0 or (allowed_ids is not None and model[j] not in allowed_ids) or mem_cap[j] < floor:
            continue
        if mig and (profile[j] < 0 or (want_profile is not None and profile[j] != want_profile)):
            continue
        if not mig and lock[j] == LOCK_MIG:
            continue
        if whole:
            ok = (
                free[j] == cap[j]
                and mem_free[j] == mem_cap[j]
                and tier[j] == TIER_NONE
                and (not req.gpu_memory_mib or mem_cap[j] >= req.gpu_memory_mib)
                and (req.gpu_milli >= MILLI_PER_DEVICE or cap[j] >= req.gpu_milli)
            )
        else:
            mem = req.gpu_memory_mib
            if mem is None:
                mem = (mem_cap[j] * req.gpu_milli) // MILLI_PER_DEVICE
            ok = free[j] >= req.gpu_milli and mem_free[j] >= mem and tier[j] in (TIER_NONE, my_tier)
            if ok and owner is not None and tier[j] == TIER_MPS:
                ok = owner[j] == me  # another tenant's mps slices: not shared
        if ok:
            usable.append(j)
    if len(usable) < k:
        return 0
    if how == "best":
        usable.sort(key=lambda j: (free[j], mem_free[j], j))
    elif how == "random" and rng is not None:
        usable = [usable[i] for i in rng.permutation(len(usable))]
    if k > 1 and state.gpu_link is not None:  # several devices: of one NVLink group when possible
        usable = linked_choice(state.gpu_link[node].tolist(), usable, k)
    mask = 0
    for j in usable[:k]:
        mask |= 1 << j
    return mask


def linked_choice(links: list[int], usable: list[int], k: int) -> list[int]:
    """k of the `usable` devices (in order of preference) spanning the fewest NVLink groups.

    One group holding k wins, the smallest such (big groups stay whole for bigger requests), then
    the one holding the most preferred device; otherwise whole groups, largest first. A device
    with no known group (-1) is a group of its own.
    """
    groups: dict[int, list[int]] = {}
    for rank, j in enumerate(usable):
        groups.setdefault(links[j] if links[j] >= 0 else -2 - rank, []).append(j)
    if len(groups) == 1:
        return usable[:k]
    whole = [g for g in groups.values() if len(g) >= k]
    if whole:
        return min(whole, key=lambda g: (len(g), usable.index(g[0])))[:k]
    out: list[int] = []
    for g in sorted(groups.values(), key=lambda g: (-len(g), usable.index(g[0]))):
        out.extend(g[: k - len(out)])
        if len(out) == k:
            break
    return out
