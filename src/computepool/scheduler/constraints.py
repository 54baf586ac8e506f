"""Node-level placement rules: labels a request selects, taints it must tolerate, dedicated nodes.

These are the pool's *static* capacity tools, checked per node before any device is looked at:

- **Selector** (as Kubernetes' `nodeSelector`): a request's `node_selector` keeps it to nodes
  whose labels have every one of its `key=value` pairs.
- **Taints** (Kubernetes' `NoSchedule` effect only): a taint `key=value` keeps off every request
  that does not tolerate it; a toleration `key=value` tolerates that taint, a bare `key` tolerates
  the key with any value. Taints only steer new placements; running work stays.
- **Dedication** (like a Slurm reservation with an owner): a node set aside for one tenant takes
  that tenant's work first. Others may *borrow* it only when the node lends (the default), and
  such work is preemptible: the owner's pending work takes the node back. `lending=False` keeps
  everyone else off.

Rules are per node, not per node class (two idle nodes of one type share a class but may carry
different labels), so they are applied as a node mask beside `schedulable`, cached per rule key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from computepool.core.request import Request, stack_at_least

# What `rejections` codes mean, in the words `explain` shows.
OK, SELECTOR, TAINT, DEDICATED, STACK = 0, 1, 2, 3, 4
LABELS = {
    SELECTOR: "node selector",
    TAINT: "untolerated taint",
    DEDICATED: "dedicated to another tenant",
    STACK: "software stack",
}
STACK_LABEL = "stack."  # a node's stack.cuda=12.4: the version of a software stack it provides


def tolerates(tolerations: frozenset[str], key: str, value: str) -> bool:
    """A bare key tolerates any value of it (Kubernetes' `Exists`); `key=value` only that one."""
    return key in tolerations or f"{key}={value}" in tolerations


@dataclass(frozen=True)
class NodeRules:
    """One node's static placement rules, as stored on the node."""

    labels: Mapping[str, str] = field(default_factory=dict)
    taints: Mapping[str, str] = field(default_factory=dict)
    dedicated_to: str | None = None
    lending: bool = True


class NodeConstraints:
    """The rules of every node of a `ClusterState` (same order), as masks per request.

    Built once per snapshot; masks are cached by (selector, tolerations, tenant), so a cycle
    pays for each distinct combination once however many requests share it.
    """

    def __init__(self, rules: Sequence[NodeRules]) -> None:
        n = len(rules)
        self.n = n
        self._label_vals: dict[str, dict[str, int]] = {}
        self._label_cols: dict[str, np.ndarray] = {}
        for i, r in enumerate(rules):
            for k, v in r.labels.items():
                vals = self._label_vals.setdefault(k, {})
                col = self._label_cols.setdefault(k, np.full(n, -1, dtype=np.int64))
                col[i] = vals.setdefault(v, len(vals))
        taints = sorted({t for r in rules for t in r.taints.items()})
        self.taints: list[tuple[str, str]] = taints
        self._taint_ix = {t: j for j, t in enumerate(taints)}
        self._tainted = np.zeros((n, len(taints)), dtype=bool)
        for i, r in enumerate(rules):
            for t in r.taints.items():
                self._tainted[i, self._taint_ix[t]] = True
        self.owners: list[str] = sorted({r.dedicated_to for r in rules if r.dedicated_to})
        owner_ix = {t: j for j, t in enumerate(self.owners)}
        self.owner = np.array(
            [owner_ix[r.dedicated_to] if r.dedicated_to else -1 for r in rules], dtype=np.int64
        )
        self.lending = np.array([r.lending for r in rules], dtype=bool)
        self._owner_ix = owner_ix
        self._cache: dict[tuple[object, ...], np.ndarray] = {}

    # --- per request ------------------------------------------------------------------------
    def key(self, req: Request) -> tuple[object, ...]:
        """What a request's node mask depends on (the tenant only where some node is dedicated)."""
        return (*req.node_rules_key, req.tenant if self.owners else "")

    def _tenant_ix(self, tenant: str) -> int:
        return self._owner_ix.get(tenant, -2)  # -2: owns nothing (never equal to a node's owner)

    def selector_ok(self, selector: tuple[tuple[str, str], ...]) -> np.ndarray:
        ok = np.ones(self.n, dtype=bool)
        for k, v in selector:
            col = self._label_cols.get(k)
            vid = self._label_vals.get(k, {}).get(v)
            if col is None or vid is None:
                return np.zeros(self.n, dtype=bool)
            ok &= col == vid
        return ok

    def stack_ok(self, stacks: tuple[tuple[str, str], ...]) -> np.ndarray:
        """Nodes that provide each stack at least at the version asked (label stack.NAME=VERSION)."""
        ok = np.ones(self.n, dtype=bool)
        for name, want in stacks:
            col, values = self.label_column(STACK_LABEL + name)
            good = np.array([stack_at_least(v, want) for v in values] + [False], dtype=bool)
            ok &= good[col]  # -1 (no such label) reads the trailing False
        return ok

    def taint_ok(self, tolerations: frozenset[str]) -> np.ndarray:
        if not self.taints:
            return np.ones(self.n, dtype=bool)
        bad = np.array([not tolerates(tolerations, k, v) for k, v in self.taints], dtype=bool)
        return np.logical_not(np.any(self._tainted[:, bad], axis=1))

    def dedication_ok(self, tenant: str) -> np.ndarray:
        return (self.owner < 0) | (self.owner == self._tenant_ix(tenant)) | self.lending

    def rejections(self, req: Request) -> np.ndarray:
        """Per node, the first rule that keeps `req` off it (`OK` where none does)."""
        code = np.full(self.n, OK, dtype=np.int64)
        for c, ok in (
            (DEDICATED, self.dedication_ok(req.tenant)),
            (TAINT, self.taint_ok(req.tolerations)),
            (SELECTOR, self.selector_ok(req.node_selector)),
            (STACK, self.stack_ok(req.stacks)),
        ):
            code[~ok] = c  # later rules overwrite: the selector is named first, as it is checked first
        return code

    def allowed(self, req: Request) -> np.ndarray:
        """Nodes whose rules let `req` on (capacity aside). Cached; do not modify the result."""
        k = self.key(req)
        hit = self._cache.get(k)
        if hit is None:
            hit = self.rejections(req) == OK
            hit.setflags(write=False)
            self._cache[k] = hit
        return hit

    def borrowed(self, req: Request) -> np.ndarray:
        """Nodes where `req` would run on another tenant's dedicated capacity (preemptible there)."""
        return (self.owner >= 0) & (self.owner != self._tenant_ix(req.tenant))

    def owned(self, tenant: str) -> np.ndarray:
        """Nodes dedicated to `tenant`."""
        return self.owner == self._tenant_ix(tenant)

    def preference(self, req: Request) -> list[np.ndarray | None]:
        """Node masks to try in turn (None: every allowed node).

        The owner's work fills its dedicated nodes first; everyone else's fills undedicated ones
        first and borrows dedicated nodes only when nothing else fits, so a borrower is not
        placed where it is the first to be preempted while free general capacity is left.
        """
        if not self.owners:
            return [None]
        own = self.owned(req.tenant)
        if own.any():
            return [own, None]
        lent = self.borrowed(req)
        if (lent & self.lending).any():
            return [~lent, None]
        return [None]

    def notes(self, req: Request, code: np.ndarray | None = None) -> list[str]:
        """Readable reasons beside the per-node counts (`code`: `rejections(req)`, maybe masked)."""
        code = self.rejections(req) if code is None else code
        out: list[str] = []
        if req.node_selector and not self.selector_ok(req.node_selector).any():
            pairs = ",".join(f"{k}={v}" for k, v in req.node_selector)
            out.append(f"node selector {pairs} matches no node's labels (nodes that join later may)")
        if req.stacks and not self.stack_ok(req.stacks).any():
            wanted = ", ".join(f"{n} ≥ {v}" for n, v in req.stacks)
            out.append(
                f"no node provides {wanted} (a node says so with its {STACK_LABEL}NAME=VERSION labels)"
            )
        tainted = code == TAINT
        if tainted.any():
            hit = self._tainted[tainted].any(axis=0)
            names = [
                f"{k}={v}"
                for (k, v), h in zip(self.taints, hit, strict=True)
                if h and not tolerates(req.tolerations, k, v)
            ]
            out.append(
                f"untolerated taints {', '.join(names)}: only work with a matching toleration goes there"
            )
        n_ded = int((code == DEDICATED).sum())
        if n_ded:
            out.append(
                f"{n_ded} node{'s' if n_ded > 1 else ''} dedicated to another tenant, not lent to others"
            )
        return out

    def label_column(self, key: str) -> tuple[np.ndarray, list[str]]:
        """Per node, the index of its value of label `key` (-1: no such label), and the values."""
        col = self._label_cols.get(key)
        if col is None:
            return np.full(self.n, -1, dtype=np.int64), []
        vals = self._label_vals[key]
        names = [""] * len(vals)
        for v, i in vals.items():
            names[i] = v
        return col, names

    def owner_of(self, i: int) -> str | None:
        o = int(self.owner[i])
        return self.owners[o] if o >= 0 else None
