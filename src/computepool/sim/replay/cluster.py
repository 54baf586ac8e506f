"""Whole 8-GPU nodes of the replay: free GPUs per node and the consolidating placement.

Kept apart from the event loop because the parity search sizes clusters with `gang_shape` too.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from computepool.sim.philly import GPUS_PER_NODE


class Nodes:
    """Free GPUs per node (numpy) plus a histogram by free count for O(1) "does it fit"."""

    def __init__(self, count: int, offset: int = 0) -> None:
        self.free = np.full(count, GPUS_PER_NODE, dtype=np.int64)
        self.hist = [0] * GPUS_PER_NODE + [count]
        self.offset = offset

    def fits(self, per_node: int, k: int) -> bool:
        return sum(self.hist[per_node:]) >= k

    def choose(self, per_node: int, k: int) -> tuple[int, ...] | None:
        """Consolidate: nodes with the fewest free GPUs that fit, lowest index on ties."""
        if not self.fits(per_node, k):
            return None
        key = np.where(self.free >= per_node, self.free, GPUS_PER_NODE + 1)
        if k == 1:
            return (int(key.argmin()),)
        return tuple(int(i) for i in np.sort(np.argsort(key, kind="stable")[:k]))

    def take(self, nodes: Iterable[int], per_node: int) -> None:
        for n in nodes:
            f = int(self.free[n])
            if f < per_node:
                raise AssertionError(f"node {n} has {f} free GPUs, needs {per_node}")
            self.hist[f] -= 1
            self.hist[f - per_node] += 1
            self.free[n] = f - per_node

    def give(self, nodes: Iterable[int], per_node: int) -> None:
        for n in nodes:
            f = int(self.free[n])
            self.hist[f] -= 1
            self.hist[f + per_node] += 1
            self.free[n] = f + per_node


def gang_shape(gpus: int) -> tuple[int, int]:
    """(GPUs per node, nodes): one node up to 8 GPUs, else whole 8-GPU nodes."""
    if gpus <= GPUS_PER_NODE:
        return gpus, 1
    return GPUS_PER_NODE, -(-gpus // GPUS_PER_NODE)
