"""The scheduler's view of the pool: free capacity as numpy arrays, and node classes.

A *node class* is an exact node state (free and total capacity, device models and kinds, the
isolation tier each device holds and the tenant owning its mps slices, what kinds of work it
hosts). Nodes in the same class are interchangeable for every node-local score, so scores are
computed once per (request kind, class) and cached: most of a large pool is in a handful of
classes (all idle nodes of one type share one), and a placement moves one node to another class
without touching the cache of any other.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import numpy as np

from computepool.core.allocation import Isolation
from computepool.core.request import Request
from computepool.core.resources import Node, mig_profile_of
from computepool.core.vendors import canonical
from computepool.scheduler.constraints import NodeConstraints
from computepool.scheduler.views import DEVICE_BLOCKS, FIXED_COLUMNS, ClassView, NodeView

# Bits of the `kinds` column: what kind of work a node already hosts (used by `clustering`).
# Bit 0: fractional ("shared") placements; bit k (1..61): placements of k whole devices;
# bit 62: CPU-only placements.
TAG_SHARED = 0
TAG_CPU_ONLY = 62
N_TAGS = 63


def tag_of(gpu_count: int, fractional: bool) -> int:
    """The kind tag of a placement."""
    if gpu_count == 0:
        return TAG_CPU_ONLY
    if fractional:
        return TAG_SHARED
    return min(gpu_count, 61)


# The isolation tier a device holds while it holds slices (`gpu_tier`); 0 while it holds none.
TIER_NONE = 0
TIER_CODE = {Isolation.TIMESLICE: 1, Isolation.MPS: 2, Isolation.EXCLUSIVE: 3, Isolation.MIG: 4}
TIER_NAME = {code: str(t) for t, code in TIER_CODE.items()}
TIER_TIMESLICE = TIER_CODE[Isolation.TIMESLICE]  # the lowest code: `lock <= TIER_TIMESLICE` is one test
TIER_MPS = TIER_CODE[Isolation.MPS]
LOCK_MIG = 8  # `gpu_lock` of a MIG instance: above every tier, so no share-tier test admits it


def tier_code(req: Request) -> int:
    """The code of the tier `req`'s slices get (TIER_NONE for CPU-only work)."""
    t = req.tier
    return TIER_NONE if t is None else TIER_CODE[t]


@dataclass
class Change:
    """What a placement took from one node (kept so it can be given back exactly)."""

    node: int
    cpu_milli: int
    memory_mib: int
    gpu_milli: dict[int, int]
    gpu_memory_mib: dict[int, int]
    tag: int
    tier: int = TIER_NONE  # the slices' tier (TIER_NONE: unknown, compatible with any)
    tenant: str = ""  # whose slices: a device's mps slices belong to one tenant at a time


@dataclass
class ClusterState:
    """Free capacity per node and per device. Devices are padded to G per node (model -1).

    Each device also has a kind (`gpu_profile`: -1 for a whole GPU, else the index of its MIG
    profile in `profiles`; `gpu_parent` indexes its GPU's uuid in `parents`), the tier of the
    slices it holds (`gpu_tier`) and how many it holds (`gpu_slices`): a device holds one tier
    at a time, and its tier is cleared when its last slice goes. A device holding mps slices
    also has an owner (`gpu_owner`, an index into `owners`): MPS runs one Unix user's server per
    GPU, and every job runs as its tenant's user, so mps slices of two tenants would take turns
    on the device instead of sharing it.
    """

    names: list[str]
    models: list[str]
    cpu_cap: np.ndarray
    mem_cap: np.ndarray
    cpu_free: np.ndarray
    mem_free: np.ndarray
    gpu_cap: np.ndarray  # (N, G) milli; 0 where no device
    gpu_free: np.ndarray  # (N, G) milli
    gpu_mem_cap: np.ndarray  # (N, G) MiB
    gpu_mem_free: np.ndarray  # (N, G) MiB
    gpu_model: np.ndarray  # (N, G) index into `models`, -1 where no device
    kinds: np.ndarray  # (N,) HOSTS_* bits
    schedulable: np.ndarray  # (N,) bool
    hosted: np.ndarray  # (N, N_TAGS) placements per kind tag
    gpu_profile: np.ndarray  # (N, G) index into `profiles`; -1 for a whole GPU or no device
    gpu_parent: np.ndarray  # (N, G) index into `parents` (MIG instances); -1 otherwise
    gpu_tier: np.ndarray  # (N, G) TIER_* of the slices held; TIER_NONE when none
    gpu_slices: np.ndarray  # (N, G) slices held
    gpu_owner: np.ndarray  # (N, G) index into `owners` of the tenant whose mps slices it holds; else -1
    profiles: list[str]
    parents: list[str]
    owners: list[str]  # tenants that hold or held mps slices (interned by `apply`)
    rules: NodeConstraints | None = None  # labels, taints, dedication (None: no node has any)
    # (N, G) NVLink group of each device, an index into `links`; -1: none known (see topology.py)
    gpu_link: np.ndarray | None = None
    links: list[str] = field(default_factory=list)
    topology_label: str | None = None  # node label a gang's members prefer to share (e.g. "rack")
    model_vendor: list[str] = field(default_factory=list)  # each of `models`' vendor ("" unknown)
    idle_devices: np.ndarray = field(init=False)  # (N,) whole GPUs (not MIG instances) wholly free
    gpu_lock: np.ndarray = field(init=False)  # (N, G) gpu_tier, or LOCK_MIG for a MIG instance
    gpu_left: np.ndarray = field(init=False)  # (N,) free compute summed over devices
    class_of: np.ndarray = field(init=False)  # (N,) class id per node
    node_stamp: np.ndarray = field(init=False)  # (N,) stamp of the node's class instance
    _owner_ids: dict[str, int] = field(init=False, default_factory=dict)
    _class_ids: dict[bytes, int] = field(init=False, default_factory=dict)
    _class_keys: list[bytes] = field(init=False, default_factory=list)
    _class_rows: np.ndarray = field(init=False)
    _class_refs: list[int] = field(init=False, default_factory=list)
    _class_stamp: list[int] = field(init=False, default_factory=list)
    _free_ids: list[int] = field(init=False, default_factory=list)
    # nodes whose class changed, in order; `changed_base` counts entries dropped from the front
    changed: list[int] = field(init=False, default_factory=list)
    changed_base: int = field(init=False, default=0)
    _next_stamp: int = field(init=False, default=0)
    version: int = field(init=False, default=0)
    uid: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.uid = uuid.uuid4().hex  # identifies this state to score caches
        self._owner_ids = {t: i for i, t in enumerate(self.owners)}
        n, g = self.gpu_free.shape
        self.gpu_lock = np.where(self.gpu_profile >= 0, LOCK_MIG, self.gpu_tier)
        self.idle_devices = (
            (self.gpu_free == self.gpu_cap)
            & (self.gpu_mem_free == self.gpu_mem_cap)
            & (self.gpu_cap > 0)
            & (self.gpu_lock == TIER_NONE)
        ).sum(axis=1)
        self.gpu_left = self.gpu_free.sum(axis=1)
        self.class_of = np.zeros(n, dtype=np.int64)
        self.node_stamp = np.zeros(n, dtype=np.int64)
        self._class_rows = np.zeros((max(64, 2 * n), FIXED_COLUMNS + DEVICE_BLOCKS * g), dtype=np.int64)
        for i in range(n):
            cid = self._class_for(self._row(i))
            self.class_of[i] = cid
            self.node_stamp[i] = self._class_stamp[cid]
            self._class_refs[cid] += 1

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_nodes(cls, nodes: list[Node], max_devices: int | None = None) -> ClusterState:
        models: list[str] = []
        vendors: list[str] = []
        model_ix: dict[str, int] = {}
        g = max_devices if max_devices is not None else max((n.gpu_count for n in nodes), default=0)
        g = max(8, -(-g // 8) * 8)  # a multiple of 8: a row of bools is then whole 64-bit words
        n = len(nodes)
        gpu_cap = np.zeros((n, g), dtype=np.int64)
        gpu_mem = np.zeros((n, g), dtype=np.int64)
        gpu_model = np.full((n, g), -1, dtype=np.int64)
        gpu_profile = np.full((n, g), -1, dtype=np.int64)
        gpu_parent = np.full((n, g), -1, dtype=np.int64)
        profiles: list[str] = []
        parents: list[str] = []
        gpu_link = np.full((n, g), -1, dtype=np.int64)
        links: dict[str, int] = {}
        for i, node in enumerate(nodes):
            for j, dev in enumerate(node.devices):
                if dev.model not in model_ix:
                    model_ix[dev.model] = len(models)
                    models.append(dev.model)
                    vendors.append(canonical(dev.vendor) or dev.vendor.lower())
                gpu_cap[i, j] = dev.compute_milli
                gpu_mem[i, j] = dev.memory_mib
                gpu_model[i, j] = model_ix[dev.model]
                if dev.link_group:
                    gpu_link[i, j] = links.setdefault(dev.link_group, len(links))
                if dev.mig_parent_uuid is not None:
                    profile = dev.mig_profile or mig_profile_of(dev.model)
                    if profile not in profiles:
                        profiles.append(profile)
                    gpu_profile[i, j] = profiles.index(profile)
                    parents.append(dev.mig_parent_uuid)
                    gpu_parent[i, j] = len(parents) - 1
        cpu = np.array([nd.cpu_milli for nd in nodes], dtype=np.int64)
        mem = np.array([nd.memory_mib for nd in nodes], dtype=np.int64)
        return cls(
            names=[nd.name for nd in nodes],
            models=models,
            cpu_cap=cpu,
            mem_cap=mem,
            cpu_free=cpu.copy(),
            mem_free=mem.copy(),
            gpu_cap=gpu_cap,
            gpu_free=gpu_cap.copy(),
            gpu_mem_cap=gpu_mem,
            gpu_mem_free=gpu_mem.copy(),
            gpu_model=gpu_model,
            kinds=np.zeros(n, dtype=np.int64),
            schedulable=np.array([nd.schedulable for nd in nodes], dtype=bool),
            hosted=np.zeros((n, N_TAGS), dtype=np.int64),
            gpu_profile=gpu_profile,
            gpu_parent=gpu_parent,
            gpu_tier=np.zeros((n, g), dtype=np.int64),
            gpu_slices=np.zeros((n, g), dtype=np.int64),
            gpu_owner=np.full((n, g), -1, dtype=np.int64),
            profiles=profiles,
            parents=parents,
            owners=[],
            gpu_link=gpu_link if links else None,
            links=list(links),
            model_vendor=vendors,
        )

    def copy(self) -> ClusterState:
        """An independent copy (the class table is rebuilt, which is cheap)."""
        return ClusterState(
            names=list(self.names),
            models=list(self.models),
            cpu_cap=self.cpu_cap.copy(),
            mem_cap=self.mem_cap.copy(),
            cpu_free=self.cpu_free.copy(),
            mem_free=self.mem_free.copy(),
            gpu_cap=self.gpu_cap.copy(),
            gpu_free=self.gpu_free.copy(),
            gpu_mem_cap=self.gpu_mem_cap.copy(),
            gpu_mem_free=self.gpu_mem_free.copy(),
            gpu_model=self.gpu_model.copy(),
            kinds=self.kinds.copy(),
            schedulable=self.schedulable.copy(),
            hosted=self.hosted.copy(),
            gpu_profile=self.gpu_profile.copy(),
            gpu_parent=self.gpu_parent.copy(),
            gpu_tier=self.gpu_tier.copy(),
            gpu_slices=self.gpu_slices.copy(),
            gpu_owner=self.gpu_owner.copy(),
            profiles=list(self.profiles),
            parents=list(self.parents),
            owners=list(self.owners),
            rules=self.rules,
            gpu_link=None if self.gpu_link is None else self.gpu_link.copy(),
            links=list(self.links),
            topology_label=self.topology_label,
            model_vendor=list(self.model_vendor),
        )

    # --- sizes ----------------------------------------------------------------------------
    @property
    def n_nodes(self) -> int:
        return len(self.names)

    @property
    def max_devices(self) -> int:
        return int(self.gpu_free.shape[1])

    def model_id(self, name: str) -> int:
        try:
            return self.models.index(name)
        except ValueError:
            return -2  # matches no device

    def profile_id(self, name: str) -> int:
        """The index of a MIG profile in `profiles`; -2 (matches no device) when none has it."""
        try:
            return self.profiles.index(name)
        except ValueError:
            return -2

    def owner_id(self, tenant: str) -> int:
        """The index of a tenant in `owners`; -2 (owns no device) when it never held mps slices."""
        return self._owner_ids.get(tenant, -2)

    def _owner_code(self, tenant: str) -> int:
        i = self._owner_ids.get(tenant)
        if i is None:
            i = self._owner_ids[tenant] = len(self.owners)
            self.owners.append(tenant)
        return i

    def profiles_by_size(self) -> list[str]:
        """MIG profiles present, smallest first (by the largest memory, then compute, of its instances)."""
        size: dict[int, tuple[int, int]] = {}
        for p, mem, cap in zip(
            self.gpu_profile[self.gpu_profile >= 0].tolist(),
            self.gpu_mem_cap[self.gpu_profile >= 0].tolist(),
            self.gpu_cap[self.gpu_profile >= 0].tolist(),
            strict=True,
        ):
            m, c = size.get(p, (0, 0))
            size[p] = (max(m, mem), max(c, cap))
        return [self.profiles[p] for p in sorted(size, key=lambda p: (*size[p], self.profiles[p]))]

    # --- node classes ---------------------------------------------------------------------
    def _row(self, i: int) -> np.ndarray:
        return np.concatenate(
            (
                [
                    self.cpu_free[i],
                    self.mem_free[i],
                    self.cpu_cap[i],
                    self.mem_cap[i],
                    self.kinds[i],
                ],
                self.gpu_free[i],
                self.gpu_mem_free[i],
                self.gpu_model[i],
                self.gpu_cap[i],
                self.gpu_mem_cap[i],
                self.gpu_tier[i],
                self.gpu_profile[i],
                self.gpu_owner[i],  # -1 except on devices holding mps slices: classes stay shared
            )
        ).astype(np.int64)

    def _class_for(self, row: np.ndarray) -> int:
        """The class id of a node state, creating (or recycling) one when it is new.

        Ids of classes no node holds any more are reused; each (re)use gets a fresh stamp, so a
        cache keyed by class id can tell a recycled id from the state it cached.
        """
        key = row.tobytes()
        cid = self._class_ids.get(key)
        if cid is not None:
            return cid
        self._next_stamp += 1
        if self._free_ids:
            cid = self._free_ids.pop()
            self._class_keys[cid] = key
            self._class_refs[cid] = 0
            self._class_stamp[cid] = self._next_stamp
        else:
            cid = len(self._class_keys)
            if cid >= len(self._class_rows):
                grown = np.zeros((2 * len(self._class_rows), self._class_rows.shape[1]), np.int64)
                grown[: len(self._class_rows)] = self._class_rows
                self._class_rows = grown
            self._class_keys.append(key)
            self._class_refs.append(0)
            self._class_stamp.append(self._next_stamp)
        self._class_rows[cid] = row
        self._class_ids[key] = cid
        return cid

    @property
    def n_classes(self) -> int:
        """Upper bound of class ids in use (cache arrays are sized by it)."""
        return len(self._class_keys)

    @property
    def live_classes(self) -> int:
        return len(self._class_ids)

    def class_view(self, class_ids: np.ndarray) -> ClassView:
        """The states of the given classes, split into named arrays for the scorers."""
        return ClassView(self._class_rows[class_ids], self.max_devices)

    def node_view(self) -> NodeView:
        """All nodes, read straight from the state arrays (no copy)."""
        return NodeView(self)

    def _touch(self, i: int) -> None:
        cap = self.gpu_cap[i]
        self.gpu_left[i] = int(self.gpu_free[i].sum())
        self.idle_devices[i] = int(
            (
                (self.gpu_free[i] == cap)
                & (self.gpu_mem_free[i] == self.gpu_mem_cap[i])
                & (cap > 0)
                & (self.gpu_lock[i] == TIER_NONE)
            ).sum()
        )
        old = int(self.class_of[i])
        cid = self._class_for(self._row(i))
        if cid != old:
            self._class_refs[cid] += 1
            self._class_refs[old] -= 1
            if self._class_refs[old] == 0:
                del self._class_ids[self._class_keys[old]]
                self._free_ids.append(old)
            self.class_of[i] = cid
            self.node_stamp[i] = self._class_stamp[cid]
            if len(self.changed) >= 8 * len(self.names) + 64:  # readers that far behind rescan
                self.changed_base += len(self.changed)
                self.changed.clear()
            self.changed.append(i)
        self.version += 1

    # --- changes --------------------------------------------------------------------------
    def apply(self, change: Change, *, touch: bool = True) -> None:
        """Take what `change` holds. `touch=False` defers the node's aggregates and class to
        `touch_nodes` (many changes on few nodes: one class lookup per node, not per change)."""
        i = change.node
        self.cpu_free[i] -= change.cpu_milli
        self.mem_free[i] -= change.memory_mib
        free, slices, tier, t = self.gpu_free[i], self.gpu_slices[i], self.gpu_tier[i], change.tier
        for j, m in change.gpu_milli.items():  # row views: cheaper to index than [i, j]
            free[j] -= m
            slices[j] += 1
            if t != TIER_NONE and tier[j] == TIER_NONE:
                tier[j] = t
                if self.gpu_profile[i, j] < 0:
                    self.gpu_lock[i, j] = t
                if t == TIER_MPS:  # the first mps slice makes its tenant the device's owner
                    self.gpu_owner[i, j] = self._owner_code(change.tenant)
        mem_free = self.gpu_mem_free[i]
        for j, m in change.gpu_memory_mib.items():
            mem_free[j] -= m
        self.hosted[i, change.tag] += 1
        if self.hosted[i, change.tag] == 1:
            self.kinds[i] |= 1 << change.tag
        if touch:
            self._touch(i)

    def undo(self, change: Change, *, touch: bool = True) -> None:
        """Give back what `change` took (`touch` as for `apply`)."""
        i = change.node
        self.cpu_free[i] += change.cpu_milli
        self.mem_free[i] += change.memory_mib
        free, slices = self.gpu_free[i], self.gpu_slices[i]
        for j, m in change.gpu_milli.items():
            free[j] += m
            slices[j] -= 1
            if slices[j] == 0:
                self.gpu_tier[i, j] = TIER_NONE
                self.gpu_owner[i, j] = -1
                if self.gpu_profile[i, j] < 0:
                    self.gpu_lock[i, j] = TIER_NONE
        mem_free = self.gpu_mem_free[i]
        for j, m in change.gpu_memory_mib.items():
            mem_free[j] += m
        self.hosted[i, change.tag] -= 1
        if self.hosted[i, change.tag] == 0:
            self.kinds[i] &= ~(1 << change.tag)
        if touch:
            self._touch(i)

    def touch_nodes(self, nodes: set[int]) -> None:
        """Bring aggregates and classes up to date after `apply`/`undo` with `touch=False`."""
        for i in sorted(nodes):
            self._touch(i)

    def eligible(self, req: Request) -> np.ndarray:
        """Schedulable nodes whose labels, taints and dedication let `req` on."""
        if self.rules is None:  # no node carries labels: a selector (or a stack) matches none
            fussy = req.node_selector or req.stacks
            return self.schedulable if not fussy else np.zeros_like(self.schedulable)
        return self.schedulable & self.rules.allowed(req)

    def set_schedulable(self, i: int, ok: bool) -> None:
        self.schedulable[i] = ok
        self.version += 1

    # --- totals ---------------------------------------------------------------------------
    def gpu_capacity_milli(self) -> int:
        return int(self.gpu_cap.sum())

    def gpu_allocated_milli(self) -> int:
        return int(self.gpu_cap.sum() - self.gpu_free.sum())

    def check_invariants(self) -> None:
        """Raise if any node or device is over-committed (used by tests and debug runs)."""
        assert (self.cpu_free >= 0).all(), "cpu over-committed"
        assert (self.mem_free >= 0).all(), "memory over-committed"
        assert (self.gpu_free >= 0).all(), "gpu compute over-committed"
        assert (self.gpu_mem_free >= 0).all(), "gpu memory over-committed"
        assert (self.gpu_free <= self.gpu_cap).all(), "gpu free above capacity"
        assert (self.gpu_slices >= 0).all(), "negative slice count"
        assert ((self.gpu_tier == TIER_NONE) | (self.gpu_slices > 0)).all(), "tier left on an empty device"
        mig = self.gpu_profile >= 0
        held = self.gpu_slices > 0
        t_mig, t_excl = TIER_CODE[Isolation.MIG], TIER_CODE[Isolation.EXCLUSIVE]
        alone = (self.gpu_tier == t_excl) | (self.gpu_tier == t_mig)
        assert (self.gpu_slices[alone] <= 1).all(), "an exclusive or MIG slice shares its device"
        assert (self.gpu_tier[mig & held] == t_mig).all(), "non-MIG slice on a MIG instance"
        assert (self.gpu_tier[~mig] != t_mig).all(), "MIG slice on a whole GPU"
        assert (self.gpu_lock == np.where(mig, LOCK_MIG, self.gpu_tier)).all(), "gpu_lock out of date"
        assert ((self.gpu_owner >= 0) == (self.gpu_tier == TIER_MPS)).all(), "mps owner out of date"
