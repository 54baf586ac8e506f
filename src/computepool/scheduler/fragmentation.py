"""GPU fragmentation against a workload's typical requests (the measure behind FGD).

The fragment of a node for a typical request t is the idle GPU milli that t could not use:
all of it when t needs no GPU, when t's model is not on the node, when t's CPU does not fit or
when the node lacks enough devices for t; otherwise only the devices whose free milli is
below t's per-device share. F(node) = Σ_t w_t · fragment_t(node).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from computepool.core.request import Request

TypicalKey = tuple[int, int, int, frozenset[str] | None]
_NEVER = np.iinfo(np.int64).max  # a device count no node has
_sum = np.add.reduce  # `.sum(axis)` without its Python wrapper (these run per decision)


def typical_key(req: Request) -> TypicalKey:
    """The (cpu, per-device milli, device count, models) tuple a request counts as."""
    return (req.cpu_milli, req.gpu_milli, req.gpu_count, req.models)


@dataclass(frozen=True)
class TypicalPods:
    """The most frequent request shapes covering `coverage` of requests, with weights."""

    cpu: np.ndarray
    milli: np.ndarray
    count: np.ndarray
    models: tuple[frozenset[str] | None, ...]
    weight: np.ndarray
    _access: dict[tuple[str, ...], np.ndarray] = field(default_factory=dict, compare=False, repr=False)
    _groups: dict[str, np.ndarray] = field(default_factory=dict, compare=False, repr=False)
    _group_access: dict[tuple[str, ...], np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.weight)

    @classmethod
    def from_counts(cls, counts: Counter[TypicalKey], coverage: float = 0.95) -> TypicalPods:
        """Most frequent first (ties: larger CPU, milli, count first), until `coverage` is reached;
        weights renormalised over the kept shapes."""
        total = sum(counts.values())
        if total == 0:
            return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), (), np.zeros(0))
        items = sorted(
            counts.items(),
            key=lambda kv: (kv[1], kv[0][0], kv[0][1], kv[0][2], "|".join(sorted(kv[0][3] or ()))),
            reverse=True,
        )
        kept: list[tuple[TypicalKey, int]] = []
        cum = 0
        for key, n in items:
            if cum >= coverage * total:
                break
            kept.append((key, n))
            cum += n
        return cls(
            cpu=np.array([k[0] for k, _ in kept], dtype=np.int64),
            milli=np.array([k[1] for k, _ in kept], dtype=np.int64),
            count=np.array([k[2] for k, _ in kept], dtype=np.int64),
            models=tuple(k[3] for k, _ in kept),
            weight=np.array([n / cum for _, n in kept], dtype=np.float64),
        )

    @classmethod
    def from_requests(cls, reqs: Iterable[Request], coverage: float = 0.95) -> TypicalPods:
        return cls.from_counts(Counter(typical_key(r) for r in reqs), coverage)

    def access(self, models: list[str]) -> np.ndarray:
        """(T, M+1) bool: may typical t use a device of model m (last column: no device)."""
        key = tuple(models)
        hit = self._access.get(key)
        if hit is not None:
            return hit
        acc = np.zeros((self.size, len(models) + 1), dtype=bool)
        for t, allowed in enumerate(self.models):
            for m, name in enumerate(models):
                acc[t, m] = allowed is None or name in allowed
        self._access[key] = acc
        return acc

    def groups(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Typicals grouped by what decides device usability, (per-device milli, models).

        Returns (group of each typical (T,), each group's milli (D,), each typical's device count
        with cpu-only typicals set beyond any node, so `cnt >= count` alone says "needs a GPU and
        the node has enough usable devices"). D is a few shapes where T is dozens: the per-device
        work of the scores runs over D, and only the last steps over T.
        """
        if "of" not in self._groups:
            keys: dict[tuple[int, frozenset[str] | None], int] = {}
            of = [
                keys.setdefault((int(m), md), len(keys))
                for m, md in zip(self.milli, self.models, strict=True)
            ]
            self._groups["of"] = np.array(of, dtype=np.int64)
            self._groups["milli"] = np.array([m for m, _ in keys], dtype=np.int64)
            self._groups["count"] = np.where(self.milli > 0, self.count, _NEVER)
            self._groups["first"] = np.array([of.index(d) for d in range(len(keys))], dtype=np.int64)
        g = self._groups
        return g["of"], g["milli"], g["count"]

    def group_access(self, models: list[str]) -> np.ndarray:
        """(D, M+1) bool: may a typical of group d use a device of model m (last: no device)."""
        key = tuple(models)
        hit = self._group_access.get(key)
        if hit is None:
            self.groups()
            hit = self._group_access[key] = np.ascontiguousarray(self.access(models)[self._groups["first"]].T)
        return hit


def _usable(left: np.ndarray, acc: np.ndarray, typ: TypicalPods) -> np.ndarray:
    """(…, G, T): device could host typical t's per-device share."""
    return acc & (left[..., None] >= typ.milli)


def frag_amount(cpu_free: np.ndarray, left: np.ndarray, acc: np.ndarray, typ: TypicalPods) -> np.ndarray:
    """F per node state. cpu_free (…,), left (…, G), acc (…, G, T) → (…,)."""
    total = left.sum(axis=-1)
    if typ.size == 0:
        return np.zeros(total.shape)
    usable = _usable(left, acc, typ)
    cnt = usable.sum(axis=-2)
    nonuse = (left[..., None] * ~usable).sum(axis=-2)
    feas = (cpu_free[..., None] >= typ.cpu) & (cnt >= typ.count) & (typ.milli > 0)
    frag = np.where(feas, nonuse, total[..., None])
    return frag @ typ.weight


def frag_after_share(
    cpu_free: np.ndarray,
    left: np.ndarray,
    acc: np.ndarray,
    typ: TypicalPods,
    cpu: int,
    milli: int,
) -> tuple[np.ndarray, np.ndarray]:
    """F before, and F after putting a fractional request (cpu, milli) on each device.

    Returns (F0 (B,), F1 (B, G)); only one device changes per candidate, so the per-typical
    counts are updated rather than recomputed.
    """
    total = left.sum(axis=-1)  # (B,)
    if typ.size == 0:
        return np.zeros(total.shape), np.zeros(left.shape)
    usable0 = _usable(left, acc, typ)  # (B, G, T)
    cnt0 = usable0.sum(axis=1)  # (B, T)
    nonuse0 = (left[..., None] * ~usable0).sum(axis=1)  # (B, T)
    feas0 = (cpu_free[:, None] >= typ.cpu) & (cnt0 >= typ.count) & (typ.milli > 0)
    f0 = np.where(feas0, nonuse0, total[:, None]) @ typ.weight

    left1 = left - milli  # (B, G): device i after the placement
    usable1 = acc & (left1[..., None] >= typ.milli)  # (B, G, T)
    cnt1 = cnt0[:, None, :] - usable0 + usable1
    nonuse1 = nonuse0[:, None, :] - left[..., None] * ~usable0 + left1[..., None] * ~usable1
    feas1 = ((cpu_free[:, None] - cpu) >= typ.cpu)[:, None, :] & (cnt1 >= typ.count) & (typ.milli > 0)
    frag1 = np.where(feas1, nonuse1, (total - milli)[:, None, None])
    return f0, frag1 @ typ.weight


def frag_amount_grouped(
    cpu_free: np.ndarray, left: np.ndarray, acc: np.ndarray, typ: TypicalPods
) -> np.ndarray:
    """`frag_amount` with `acc` per typical group (…, G, D) (see `TypicalPods.groups`).

    The same integer fragments per typical, summed with the same weights: equal results.
    """
    total = _sum(left, -1)
    if typ.size == 0:
        return np.zeros(total.shape)
    of, g_milli, count = typ.groups()
    usable = acc & (left[..., None] >= g_milli)
    cnt = _sum(usable, -2)[..., of]
    nonuse = _sum(left[..., None] * ~usable, -2)[..., of]
    need = np.where(cpu_free[..., None] >= typ.cpu, count, _NEVER)  # a CPU misfit needs too many devices
    return np.where(cnt >= need, nonuse, total[..., None]) @ typ.weight


def frag_after_share_grouped(
    cpu_free: np.ndarray,
    left: np.ndarray,
    acc: np.ndarray,
    typ: TypicalPods,
    cpu: int,
    milli: int,
) -> tuple[np.ndarray, np.ndarray]:
    """`frag_after_share` with `acc` per typical group (B, G, D): equal results, less work."""
    total = _sum(left, -1)  # (B,)
    if typ.size == 0:
        return np.zeros(total.shape), np.zeros(left.shape)
    of, g_milli, count = typ.groups()
    usable0 = acc & (left[..., None] >= g_milli)  # (B, G, D)
    cnt0 = _sum(usable0, 1)  # (B, D)
    lost0 = left[..., None] * ~usable0  # (B, G, D)
    nonuse0 = _sum(lost0, 1)  # (B, D)
    need0 = np.where(cpu_free[:, None] >= typ.cpu, count, _NEVER)  # (B, T)
    f0 = np.where(cnt0[:, of] >= need0, nonuse0[:, of], total[:, None]) @ typ.weight

    left1 = left - milli  # (B, G): device i after the placement
    usable1 = acc & (left1[..., None] >= g_milli)  # (B, G, D)
    cnt1 = (cnt0[:, None, :] - usable0 + usable1)[..., of]  # (B, G, T)
    nonuse1 = (nonuse0[:, None, :] - lost0 + left1[..., None] * ~usable1)[..., of]
    need1 = np.where((cpu_free[:, None] - cpu) >= typ.cpu, count, _NEVER)[:, None, :]
    frag1 = np.where(cnt1 >= need1, nonuse1, (total - milli)[:, None, None])
    return f0, frag1 @ typ.weight


def sigmoid_score(f0: np.ndarray, f1: np.ndarray, temperature: float = 1000.0) -> np.ndarray:
    """FGD's node score: 100·sigmoid((F0 − F1)/temperature), truncated to a whole number."""
    x = np.subtract(f1, f0)  # = −(f0 − f1) exactly
    x /= temperature
    np.exp(x, out=x)
    x += 1.0
    np.divide(1.0, x, out=x)
    x *= 100.0
    return np.floor(x, out=x)
