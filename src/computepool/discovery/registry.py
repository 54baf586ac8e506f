"""The peer table both transports feed: what a node believes about the other nodes of its LAN.

Trust rules (why the table is shaped this way):

- Only an announcement that `announce.verify` accepts creates or refreshes a *verified* entry, and
  verified entries are keyed by the node id the signature covers. Everything else — a bad
  signature, another pool, a replay, an unparsable datagram — lands in a separate *rejected* table
  keyed by where it came from ("ADDRESS:PORT"), so a forgery naming node X can be shown (with the
  reason) but can never replace, refresh or evict X's verified entry. The rejected table is capped
  (oldest out), so a flood of garbage costs bounded memory.
- Liveness counts only *new* announcements: an instance is "heard" when its `issued_at` moves
  forward. A replayed datagram, or an mDNS cache still holding a dead agent's TXT record, repeats an
  old `issued_at` and keeps nothing alive; such a peer drops out `expire_after_s` after it was last
  really heard. When an instance expires (or is evicted) its newest `issued_at` is kept as a
  tombstone for `MAX_SKEW_S` (after that `verify` rejects the old announcements as stale anyway), so
  replaying a departed peer's last announcement cannot bring it back into the table.
- A copied identity is two instances that both hold the key and announce one node id. It is told
  apart from a restart (new instance, the old one silent) by the senders' own clocks: two instances
  are flagged only when the older one signs again after the newer one's first announcement, i.e.
  both keep announcing. Replays of the old instance's announcements cannot fake that (they were
  signed before the new instance's first one). While flagged, every instance of that id is shown
  rejected, since nothing tells which one is genuine; the flag clears once one of them goes silent
  and expires.
  Another instance announcing *our own* node id is flagged the same way. At most
  `MAX_INSTANCES_PER_NODE` instances of one id are kept (the least recently heard one goes), so a
  key holder minting instances costs bounded memory.
- Our own instance (heard back over multicast, or relayed) is ignored.

Unverified claims are kept only as words for `cpool peers`: a rejected entry carries the node id
it claims (for the operator) but never its devices, so nothing unverified reaches placement.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Literal

from computepool.discovery.announce import MAX_SKEW_S, Announcement, DeviceSummary, verify

Source = Literal["mdns", "unicast"]
MAX_REJECTED = 256
MAX_VERIFIED = 1024
MAX_INSTANCES_PER_NODE = 4
MAX_TOMBSTONES = 4096


@dataclass(frozen=True)
class PeerView:
    """One row of what a node's discovery found (reported to the control plane as a PeerReport)."""

    peer_key: str  # node_id when verified; "ADDRESS:PORT" of the sender when rejected
    node_id: str | None  # for a rejected entry: the id it claims (unverified), if it parsed
    instance: str
    address: str
    port: int | None
    devices: tuple[DeviceSummary, ...]
    status: Literal["ok", "rejected"]
    reason: str  # "" when ok
    source: Source
    rtt_ms: float | None
    bandwidth_mbps: float | None
    last_seen: float  # unix seconds


@dataclass
class _Instance:
    instance: str
    address: str
    port: int
    devices: tuple[DeviceSummary, ...]
    source: Source
    sender: str
    first_issued: float  # sender's clock, first announcement we accepted
    last_issued: float  # sender's clock, newest announcement we accepted
    last_heard: float  # our clock, when `last_issued` arrived
    rtt_ms: float | None = None
    bandwidth_mbps: float | None = None


@dataclass
class _Node:
    instances: dict[str, _Instance] = field(default_factory=dict)
    crowded_until: float = 0.0  # our clock: a live copy was evicted by the cap; flagged till then


@dataclass
class _Rejected:
    sender: str
    node_id: str | None
    instance: str
    address: str
    port: int | None
    reason: str
    source: Source
    last_seen: float


@dataclass(frozen=True)
class Target:
    """A verified peer the link prober may measure: where its signed announcement says it answers."""

    node_id: str
    instance: str
    address: str
    port: int
    measured: bool  # both link figures were recorded for this instance (a half is tried again soon)


class Registry:
    """Thread-safe: the UDP loop, the mDNS worker and the link prober all write to it."""

    def __init__(
        self,
        key: bytes,
        *,
        node_id: str,
        instance: str,
        started_at: float,
        expire_after_s: float = 30.0,
        max_rejected: int = MAX_REJECTED,
    ) -> None:
        self._key = key
        self._node_id = node_id
        self._instance = instance
        self._started_at = started_at  # our own first_issued, for "someone else announces our id"
        self._expire = expire_after_s
        self._max_rejected = max_rejected
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        self._rejected: OrderedDict[str, _Rejected] = OrderedDict()
        # (node id, instance) -> (its newest issued_at, our clock when it went): see the module doc.
        self._gone: OrderedDict[tuple[str, str], tuple[float, float]] = OrderedDict()

    # -- input --------------------------------------------------------------------------------

    def observe(
        self,
        ann_or_error: Announcement | Exception,
        *,
        source: Source,
        sender: tuple[str, int],
        now: float,
    ) -> str | None:
        """Record one received announcement (or the error parsing it raised). Returns None when it
        was accepted (or was our own), else the reason it was rejected."""
        where = f"{sender[0]}:{sender[1]}"
        if isinstance(ann_or_error, Exception):
            text = str(ann_or_error)
            what = text if text.startswith("malformed announcement") else f"malformed announcement: {text}"
            with self._lock:
                self._reject(
                    _Rejected(where, None, "", sender[0], sender[1] or None, what[:500], source, now)
                )
            return what
        if "%" in ann_or_error.address:  # a scoped IPv6 address: the scope is free text (commas …)
            return self.observe(
                ValueError(f"malformed announcement: address {ann_or_error.address[:64]!r} has a scope"),
                source=source,
                sender=sender,
                now=now,
            )
        ann = ann_or_error
        reason = verify(ann, self._key, now)
        if reason is not None:
            with self._lock:
                self._reject(
                    _Rejected(where, ann.node_id, ann.instance, ann.address, ann.port, reason, source, now)
                )
            return reason
        if ann.instance == self._instance:
            return None
        with self._lock:
            # This sender proved itself: an older rejection recorded under its address is obsolete.
            self._rejected.pop(where, None)
            node = self._nodes.get(ann.node_id)
            if node is None:
                if len(self._nodes) >= MAX_VERIFIED:
                    self._expire_locked(now)
                    if len(self._nodes) >= MAX_VERIFIED:
                        return "peer table full"
                node = self._nodes[ann.node_id] = _Node()
            inst = node.instances.get(ann.instance)
            gone = self._gone.get((ann.node_id, ann.instance))
            if inst is None and gone is not None and ann.issued_at <= gone[0]:
                return None  # a replay of a departed instance: genuine, but no sign of life
            if inst is None:
                self._gone.pop((ann.node_id, ann.instance), None)
                while len(node.instances) >= MAX_INSTANCES_PER_NODE:
                    oldest = min(node.instances.values(), key=lambda i: i.last_heard)
                    if oldest in self._duplicates(ann.node_id, node, now)[1]:
                        # Evicting a copy that still announces must not clear the flag it raised.
                        node.crowded_until = now + self._expire
                    self._bury(ann.node_id, oldest, now)
                    del node.instances[oldest.instance]
                node.instances[ann.instance] = _Instance(
                    ann.instance,
                    ann.address,
                    ann.port,
                    ann.devices,
                    source,
                    where,
                    first_issued=ann.issued_at,
                    last_issued=ann.issued_at,
                    last_heard=now,
                )
            elif ann.issued_at > inst.last_issued:
                inst.last_issued, inst.last_heard = ann.issued_at, now
                if (inst.address, inst.port) != (ann.address, ann.port):
                    inst.rtt_ms = inst.bandwidth_mbps = None  # moved: the old link figures are moot
                inst.address, inst.port, inst.devices = ann.address, ann.port, ann.devices
                inst.source, inst.sender = source, where
            # else: a repeat or a replay of something already heard; not a sign of life.
        return None

    def set_link(
        self, node_id: str, instance: str, rtt_ms: float | None, bandwidth_mbps: float | None
    ) -> None:
        with self._lock:
            node = self._nodes.get(node_id)
            inst = node.instances.get(instance) if node else None
            if inst is not None:
                inst.rtt_ms, inst.bandwidth_mbps = rtt_ms, bandwidth_mbps

    # -- output -------------------------------------------------------------------------------

    def targets(self, now: float) -> list[Target]:
        """Verified, unflagged peers (the only ones links are measured to)."""
        with self._lock:
            self._expire_locked(now)
            out = []
            for node_id, node in self._nodes.items():
                if node_id == self._node_id or self._duplicates(node_id, node, now)[0]:
                    continue
                inst = _newest(node)
                measured = inst.rtt_ms is not None and inst.bandwidth_mbps is not None
                out.append(Target(node_id, inst.instance, inst.address, inst.port, measured))
            return out

    def snapshot(self, now: float) -> list[PeerView]:
        """Verified peers first (sorted by node id), then rejections, newest first."""
        with self._lock:
            self._expire_locked(now)
            ok: list[PeerView] = []
            flagged: list[PeerView] = []
            for node_id in sorted(self._nodes):
                node = self._nodes[node_id]
                reason, involved = self._duplicates(node_id, node, now)
                if reason:
                    flagged.extend(_view(node_id, i, "rejected", reason) for i in involved)
                elif node_id != self._node_id:  # a leftover of our own previous run is not a peer
                    ok.append(_view(node_id, _newest(node), "ok", ""))
            rejected = [
                PeerView(
                    r.sender,
                    r.node_id,
                    r.instance,
                    r.address,
                    r.port,
                    (),
                    "rejected",
                    r.reason,
                    r.source,
                    None,
                    None,
                    r.last_seen,
                )
                for r in reversed(self._rejected.values())
                if r.sender not in {v.peer_key for v in flagged}
            ]
            return ok + _unique_keys(flagged) + rejected

    # -- internals ----------------------------------------------------------------------------

    def _reject(self, entry: _Rejected) -> None:
        self._rejected.pop(entry.sender, None)
        self._rejected[entry.sender] = entry
        while len(self._rejected) > self._max_rejected:
            self._rejected.popitem(last=False)

    def _expire_locked(self, now: float) -> None:
        for node_id in list(self._nodes):
            node = self._nodes[node_id]
            for inst_id in [i for i, v in node.instances.items() if now - v.last_heard > self._expire]:
                self._bury(node_id, node.instances.pop(inst_id), now)
            if not node.instances:
                del self._nodes[node_id]
        for sender in [s for s, r in self._rejected.items() if now - r.last_seen > self._expire]:
            del self._rejected[sender]
        while self._gone and now - next(iter(self._gone.values()))[1] > MAX_SKEW_S:
            self._gone.popitem(last=False)

    def _bury(self, node_id: str, inst: _Instance, now: float) -> None:
        key = (node_id, inst.instance)
        self._gone.pop(key, None)
        self._gone[key] = (inst.last_issued, now)
        while len(self._gone) > MAX_TOMBSTONES:
            self._gone.popitem(last=False)

    def _duplicates(self, node_id: str, node: _Node, now: float) -> tuple[str, list[_Instance]]:
        """The copied-identity reason and the instances involved, when two live instances keep
        announcing `node_id` ("" and [] otherwise; an old instance that went silent is not one)."""
        insts = sorted(node.instances.values(), key=lambda i: i.first_issued)
        if now < node.crowded_until:
            return (
                f"duplicate node id {node_id}: more than {MAX_INSTANCES_PER_NODE} instances announce "
                "it (a copied identity?)",
                insts,
            )
        if node_id == self._node_id:
            copies = [i for i in insts if i.last_issued > self._started_at]
            return (
                (_dup_reason(node_id, self._instance, "this node", copies[0]), copies) if copies else ("", [])
            )
        reason, involved = "", {}
        for a_i, a in enumerate(insts):
            for b in insts[a_i + 1 :]:
                if a.last_issued > b.first_issued:  # the older one signed again after the newer began
                    reason = reason or _dup_reason(node_id, a.instance, a.sender, b)
                    involved[a.instance], involved[b.instance] = a, b
        return reason, list(involved.values())


def _dup_reason(node_id: str, inst_a: str, where_a: str, b: _Instance) -> str:
    return (
        f"duplicate node id {node_id}: instance {inst_a} at {where_a} and instance {b.instance} "
        f"at {b.sender} both announce it (a copied identity?)"
    )


def _newest(node: _Node) -> _Instance:
    return max(node.instances.values(), key=lambda i: (i.first_issued, i.last_issued))


def _view(node_id: str, inst: _Instance, status: Literal["ok", "rejected"], reason: str) -> PeerView:
    return PeerView(
        peer_key=node_id if status == "ok" else inst.sender,
        node_id=node_id,
        instance=inst.instance,
        address=inst.address,
        port=inst.port,
        devices=inst.devices if status == "ok" else (),
        status=status,
        reason=reason,
        source=inst.source,
        rtt_ms=inst.rtt_ms if status == "ok" else None,
        bandwidth_mbps=inst.bandwidth_mbps if status == "ok" else None,
        last_seen=inst.last_heard,
    )


def _unique_keys(views: list[PeerView]) -> list[PeerView]:
    """Two flagged instances behind one sender address still get distinct keys."""
    seen: set[str] = set()
    out = []
    for v in views:
        key = v.peer_key if v.peer_key not in seen else f"{v.peer_key}#{v.instance}"
        seen.add(key)
        out.append(replace(v, peer_key=key))
    return out
