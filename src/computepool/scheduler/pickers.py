"""Device pickers: which devices of the chosen node a request takes (as a bitmask per class)."""

from __future__ import annotations

import numpy as np

from computepool.core.request import Request
from computepool.scheduler.filters import DeviceNeed
from computepool.scheduler.state import View

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


def random_fit(
    view: View, req: Request, need: DeviceNeed, rng: np.random.Generator
) -> np.ndarray:
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
