"""Node states as named columns: a `View` over class rows or over every node of a `ClusterState`.

Filters, pickers and scores read capacity through these views, so one code path scores a batch of
node classes (cached) or the live nodes themselves, and the row layout lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from computepool.scheduler.state import ClusterState

# Columns of a class row; the eight per-device blocks follow, G wide each.
CPU_FREE, MEM_FREE, CPU_CAP, MEM_CAP, KINDS = range(5)
FIXED_COLUMNS = 5
DEVICE_BLOCKS = 8


class View(Protocol):
    """Node states as columns: B rows (nodes or classes), G devices each."""

    @property
    def g(self) -> int: ...
    def __len__(self) -> int: ...
    def take(self, idx: np.ndarray) -> View: ...
    @property
    def cpu_free(self) -> np.ndarray: ...
    @property
    def mem_free(self) -> np.ndarray: ...
    @property
    def cpu_cap(self) -> np.ndarray: ...
    @property
    def mem_cap(self) -> np.ndarray: ...
    @property
    def kinds(self) -> np.ndarray: ...
    @property
    def gpu_free(self) -> np.ndarray: ...
    @property
    def gpu_left(self) -> np.ndarray: ...
    @property
    def gpu_mem_free(self) -> np.ndarray: ...
    @property
    def gpu_model(self) -> np.ndarray: ...
    @property
    def gpu_cap(self) -> np.ndarray: ...
    @property
    def gpu_mem_cap(self) -> np.ndarray: ...
    @property
    def gpu_tier(self) -> np.ndarray: ...
    @property
    def gpu_profile(self) -> np.ndarray: ...
    @property
    def gpu_owner(self) -> np.ndarray: ...


@dataclass
class NodeView:
    """Every node of a state, or the nodes in `idx`, as a View."""

    state: ClusterState
    idx: np.ndarray | None = None

    @property
    def g(self) -> int:
        return self.state.max_devices

    def __len__(self) -> int:
        return self.state.n_nodes if self.idx is None else len(self.idx)

    def take(self, idx: np.ndarray) -> NodeView:
        return NodeView(self.state, idx if self.idx is None else self.idx[idx])

    def _get(self, arr: np.ndarray) -> np.ndarray:
        return arr if self.idx is None else arr[self.idx]

    @property
    def cpu_free(self) -> np.ndarray:
        return self._get(self.state.cpu_free)

    @property
    def mem_free(self) -> np.ndarray:
        return self._get(self.state.mem_free)

    @property
    def cpu_cap(self) -> np.ndarray:
        return self._get(self.state.cpu_cap)

    @property
    def mem_cap(self) -> np.ndarray:
        return self._get(self.state.mem_cap)

    @property
    def kinds(self) -> np.ndarray:
        return self._get(self.state.kinds)

    @property
    def gpu_free(self) -> np.ndarray:
        return self._get(self.state.gpu_free)

    @property
    def gpu_left(self) -> np.ndarray:
        return self._get(self.state.gpu_left)

    @property
    def gpu_mem_free(self) -> np.ndarray:
        return self._get(self.state.gpu_mem_free)

    @property
    def gpu_model(self) -> np.ndarray:
        return self._get(self.state.gpu_model)

    @property
    def gpu_cap(self) -> np.ndarray:
        return self._get(self.state.gpu_cap)

    @property
    def gpu_mem_cap(self) -> np.ndarray:
        return self._get(self.state.gpu_mem_cap)

    @property
    def gpu_tier(self) -> np.ndarray:
        return self._get(self.state.gpu_tier)

    @property
    def gpu_profile(self) -> np.ndarray:
        return self._get(self.state.gpu_profile)

    @property
    def gpu_owner(self) -> np.ndarray:
        return self._get(self.state.gpu_owner)


@dataclass
class ClassView:
    """Named columns over a batch of class rows (B classes, G devices each)."""

    rows: np.ndarray
    g: int

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, idx: np.ndarray) -> ClassView:
        return ClassView(self.rows[idx], self.g)

    @property
    def cpu_free(self) -> np.ndarray:
        return self.rows[:, CPU_FREE]

    @property
    def mem_free(self) -> np.ndarray:
        return self.rows[:, MEM_FREE]

    @property
    def cpu_cap(self) -> np.ndarray:
        return self.rows[:, CPU_CAP]

    @property
    def mem_cap(self) -> np.ndarray:
        return self.rows[:, MEM_CAP]

    @property
    def kinds(self) -> np.ndarray:
        return self.rows[:, KINDS]

    def _block(self, k: int) -> np.ndarray:
        s = FIXED_COLUMNS + k * self.g
        return self.rows[:, s : s + self.g]

    @property
    def gpu_free(self) -> np.ndarray:
        return self._block(0)

    @property
    def gpu_left(self) -> np.ndarray:
        return self._block(0).sum(axis=1)

    @property
    def gpu_mem_free(self) -> np.ndarray:
        return self._block(1)

    @property
    def gpu_model(self) -> np.ndarray:
        return self._block(2)

    @property
    def gpu_cap(self) -> np.ndarray:
        return self._block(3)

    @property
    def gpu_mem_cap(self) -> np.ndarray:
        return self._block(4)

    @property
    def gpu_tier(self) -> np.ndarray:
        return self._block(5)

    @property
    def gpu_profile(self) -> np.ndarray:
        return self._block(6)

    @property
    def gpu_owner(self) -> np.ndarray:
        return self._block(7)


def any_per_row(mask: np.ndarray) -> np.ndarray:
    """`mask.any(axis=1)` for a C-contiguous (N, 8k) bool array, reading each row as k words.

    numpy reduces slowly along a short last axis; this is one comparison instead.
    """
    words = np.ascontiguousarray(mask).view(np.uint64)
    if words.shape[1] == 1:
        return words[:, 0] != 0
    return (words != 0).any(axis=1)
