"""The built-in alert rules: their defaults, and what each finds in one look at the pool.

A rule is a pure function from `Facts` (read in one transaction) and its effective setting to the
`Finding`s that hold now, one per subject. The engine turns findings into alerts: a finding that
has held for the rule's `duration_s` fires, a firing alert whose finding is gone resolves. Rules
about moments (a kill, a leader change) hold for a window after the moment (their threshold),
so they fire once and resolve by themselves.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from computepool.core.allocation import HOLDING, PENDING
from computepool.core.quantities import format_duration
from computepool.core.vendors import canonical
from computepool.server.scheduling.snapshot import Snapshot, lost_brake
from computepool.server.settings import ServerSettings
from computepool.store.alerts import DeviceSeen, EndSeen, HeldAlloc, NodeSeen, RuleSetting

Severity = Literal["warning", "critical"]
JOB_FAILING_WINDOW_S = 3600  # job-failing counts failures within the last hour
QUOTA_PREFIX = "quota:"  # how the scheduler words a request that waits for its tenant's limit
MEMORY_KILL = "GPU memory "  # the agent's memory watchdog starts its stop reason so


@dataclass(frozen=True)
class Finding:
    """A condition of one rule that holds now about one subject."""

    subject: str
    summary: str
    tenant: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Facts:
    """What one pass of the rules looks at, read at once."""

    now: datetime
    nodes: list[NodeSeen]
    devices: list[DeviceSeen]
    held: list[HeldAlloc]
    ends: list[EndSeen]  # failed ends and lost-process requeues in the look-back
    snapshot: Snapshot | None  # nodes' capacity and live work (pending reasons) as the scheduler sees it
    term: int  # the scheduler term this replica leads in
    term_before: int | None  # the term the last leader-changed alert recorded when `term` was new
    term_changed: bool  # whether `term` is a change from that (a first leader, term 1, is not)
    term_first_seen: datetime  # when this engine first saw `term`
    audit_problem: str | None
    settings: ServerSettings
    # the effective node-lost threshold (node-suspect stops where node-lost starts)
    lost_after_s: float | None = None
    # the leader's `Leadership.since`: silence counts from no earlier, as the scheduler's does, so
    # a failover or a database outage does not make every node look suspect or lost at once
    observed_since: datetime | None = None


Check = Callable[[Facts, RuleSetting], list[Finding]]


@dataclass(frozen=True)
class Rule:
    name: str
    severity: Severity
    unit: str  # of the threshold ("" where the rule has none)
    description: str
    check: Check
    threshold: Callable[[ServerSettings], float]
    duration_s: int

    def default(self, settings: ServerSettings) -> RuleSetting:
        return RuleSetting(True, float(self.threshold(settings)), self.duration_s)


def _age(facts: Facts, at: datetime) -> float:
    return (facts.now - at).total_seconds()


def _human(seconds: float) -> str:
    return format_duration(max(1, round(seconds)))


def _quiet(facts: Facts, node: NodeSeen) -> float:
    """How long the leader has seen `node` silent: from its last heartbeat or from when this
    replica began to lead with a working database, whichever is later."""
    since = node.last_heartbeat_at
    if facts.observed_since is not None and facts.observed_since > since:
        since = facts.observed_since
    return _age(facts, since)


def _silent(facts: Facts) -> list[str]:
    """Nodes without a heartbeat for suspect_after_s: what the scheduler's brake counts."""
    quiet = facts.settings.suspect_after_s
    return [n.name for n in facts.nodes if _quiet(facts, n) >= quiet]


def node_suspect(facts: Facts, rs: RuleSetting) -> list[Finding]:
    upper = facts.lost_after_s
    out = []
    for n in facts.nodes:
        age = _quiet(facts, n)
        if age >= rs.threshold and (upper is None or age < upper):
            out.append(
                Finding(
                    f"node/{n.name}",
                    f"node {n.name}: no heartbeat for over {_human(rs.threshold)}",
                    detail={"node": n.name, "last_heartbeat_at": n.last_heartbeat_at.isoformat()},
                )
            )
    return out


def node_lost(facts: Facts, rs: RuleSetting) -> list[Finding]:
    """Nodes silent for the threshold; none while the brake holds (`nodes-silent` says why)."""
    s = facts.settings
    if lost_brake(len(_silent(facts)), len(facts.nodes), s.lost_brake_share, s.lost_brake_min_nodes):
        return []
    return [
        Finding(
            f"node/{n.name}",
            f"node {n.name} lost: no heartbeat for over {_human(rs.threshold)}; its work is moved or ended",
            detail={"node": n.name, "last_heartbeat_at": n.last_heartbeat_at.isoformat()},
        )
        for n in facts.nodes
        if _quiet(facts, n) >= rs.threshold
    ]


def nodes_silent(facts: Facts, rs: RuleSetting) -> list[Finding]:
    """More than the threshold share of the nodes silent together: the brake holds, no node is
    declared lost (and no work moved) until enough of them report again. It fires after 30 s:
    nodes whose heartbeats aged while the control plane itself was down report again sooner."""
    silent = _silent(facts)
    share = min(max(rs.threshold, 0.0), 1.0)
    if not lost_brake(len(silent), len(facts.nodes), share, facts.settings.lost_brake_min_nodes):
        return []
    return [
        Finding(
            "pool",
            f"{len(silent)} of {len(facts.nodes)} nodes silent together (more than {share:.0%}): no node is "
            "declared lost until more of them report; check the control plane's network and database",
            detail={"silent": sorted(silent), "nodes": len(facts.nodes), "share": share},
        )
    ]


def _holders(facts: Facts) -> dict[tuple[str, int], list[HeldAlloc]]:
    out: dict[tuple[str, int], list[HeldAlloc]] = defaultdict(list)
    for h in facts.held:
        for d in h.devices:
            out[d].append(h)
    return out


def _one_tenant(holders: list[HeldAlloc]) -> str | None:
    tenants = {h.tenant for h in holders}
    return tenants.pop() if len(tenants) == 1 else None


def device_unhealthy(facts: Facts, rs: RuleSetting) -> list[Finding]:
    holders = _holders(facts)
    out = []
    for d in facts.devices:
        if not d.health:
            continue
        on = holders.get((d.node, d.index), [])
        out.append(
            Finding(
                f"device/{d.node}/{d.index}",
                f"device {d.index} ({d.model}) on {d.node} unhealthy: {d.health}",
                tenant=_one_tenant(on),
                detail={
                    "node": d.node,
                    "device": d.index,
                    "model": d.model,
                    "health": d.health,
                    "allocations": [h.id for h in on],
                },
            )  # fmt: skip
        )
    return out


def slice_memory_killed(facts: Facts, rs: RuleSetting) -> list[Finding]:
    window = timedelta(seconds=rs.threshold)
    out: dict[str, Finding] = {}
    for e in facts.ends:
        if e.state != "failed" or facts.now - e.at > window:
            continue
        if not (e.reason.startswith(MEMORY_KILL) or f": {MEMORY_KILL}" in e.reason):
            continue
        subject = f"allocation/{e.allocation_id}"
        out[subject] = Finding(
            subject,
            f"allocation {e.allocation_id} ({e.tenant}/{e.owner}) killed for its GPU memory: {e.reason}",
            tenant=e.tenant,
            detail={"allocation_id": e.allocation_id, "attempt": e.attempt, "reason": e.reason,
                    "at": e.at.isoformat()},
        )  # fmt: skip
    return list(out.values())


def idle_devices(facts: Facts, rs: RuleSetting) -> list[Finding]:
    """Held devices whose fresh heartbeats show utilization at or below the threshold (a silent
    node says nothing: no finding)."""
    fresh_after = facts.now - timedelta(seconds=facts.settings.suspect_after_s)
    seen = {(d.node, d.index): d for d in facts.devices}
    out = []
    for h in facts.held:
        idle = []
        for key in h.devices:
            d = seen.get(key)
            if d is None or d.utilization_pct is None or d.heartbeat_at < fresh_after:
                continue
            if d.utilization_pct <= rs.threshold:
                idle.append(key)
        if not idle:
            continue
        names = ", ".join(f"{n}/{i}" for n, i in idle)
        job = f" ({h.name})" if h.name else ""
        out.append(
            Finding(
                f"allocation/{h.id}",
                f"allocation {h.id}{job} of {h.tenant}/{h.owner}: {len(idle)} of {len(h.devices)} held "
                f"device(s) idle ({names})",
                tenant=h.tenant,
                detail={
                    "allocation_id": h.id,
                    "idle_devices": [f"{n}/{i}" for n, i in idle],
                    "devices": len(h.devices),
                },
            )  # fmt: skip
        )
    return out


def _free_capacity(snap: Snapshot) -> tuple[dict[str, int], dict[str, int], int, int]:
    """Free GPU compute (milli) and GPU memory (MiB) per model, and free CPU and memory, summed
    over the schedulable nodes as the scheduler's snapshot has them."""
    held_milli: Counter[tuple[str, int]] = Counter()
    held_mem: Counter[tuple[str, int]] = Counter()
    host_cpu: Counter[str] = Counter()
    host_mem: Counter[str] = Counter()
    for a in snap.live:
        if a.state not in HOLDING:
            continue
        for sl in a.slices:
            key = (str(sl["node"]), int(sl["device_index"]))
            held_milli[key] += int(sl.get("compute_milli") or 0)
            held_mem[key] += int(sl.get("memory_mib") or 0)
        for name in dict.fromkeys(a.nodes):
            host_cpu[name] += a.core.cpu_milli
            host_mem[name] += a.core.memory_mib
    milli: dict[str, int] = Counter()
    mem: dict[str, int] = Counter()
    cpu = memory = 0
    for n in snap.nodes:
        if not n.schedulable or n.draining:
            continue
        cpu += max(0, n.cpu_milli - host_cpu[n.name])
        memory += max(0, n.memory_mib - host_mem[n.name])
        for d in n.devices:
            milli[d.model] += max(0, d.compute_milli - held_milli[(n.name, d.index)])
            mem[d.model] += max(0, d.memory_mib - held_mem[(n.name, d.index)])
    return milli, mem, cpu, memory


def fragmentation(facts: Facts, rs: RuleSetting) -> list[Finding]:
    """Requests waiting (not for quota) while the free capacity summed over devices and nodes
    holds `threshold` times what they ask: the pool has room, only not in one piece."""
    snap = facts.snapshot
    if snap is None:
        return []
    waiting = [a for a in snap.live if a.state == PENDING and not a.reason.startswith(QUOTA_PREFIX)]
    if not waiting:
        return []
    milli, mem, cpu, memory = _free_capacity(snap)
    vendors = {d.model: d.vendor for n in snap.nodes for d in n.devices}
    factor = max(rs.threshold, 0.0)
    out = []
    for a in waiting:
        req = a.core
        n = req.gang_nodes
        need_milli = req.gpu_count * req.gpu_milli * n
        need_gmem = req.gpu_count * (req.gpu_memory_mib or 0) * n
        need_cpu, need_mem = req.cpu_milli * n, req.memory_mib * n
        if need_milli + need_cpu + need_mem == 0:
            continue
        models = req.models if req.models else set(milli)
        if req.vendors is not None:  # another vendor's free devices are no room for it
            models = {m for m in models if canonical(vendors.get(m, "")) in req.vendors}
        free_milli = sum(milli.get(m, 0) for m in models)
        free_gmem = sum(mem.get(m, 0) for m in models)
        if (
            free_milli >= factor * need_milli
            and free_gmem >= factor * need_gmem
            and cpu >= factor * need_cpu
            and memory >= factor * need_mem
        ):
            out.append(
                Finding(
                    f"allocation/{a.id}",
                    f"allocation {a.id} of {a.tenant} waits although the pool has "
                    f"{free_milli / 1000:g} GPUs free in pieces (it asks {need_milli / 1000:g}): {a.reason}",
                    tenant=a.tenant,
                    detail={
                        "allocation_id": a.id,
                        "free_gpu_milli": free_milli,
                        "asks_gpu_milli": need_milli,
                        "reason": a.reason,
                    },
                )  # fmt: skip
            )
    return out


def tenant_at_limit(facts: Facts, rs: RuleSetting) -> list[Finding]:
    snap = facts.snapshot
    if snap is None:
        return []
    waiting: dict[str, list[int]] = defaultdict(list)
    why: dict[str, str] = {}
    for a in snap.live:
        if a.state == PENDING and a.reason.startswith(QUOTA_PREFIX):
            waiting[a.tenant].append(a.id)
            why.setdefault(a.tenant, a.reason)
    return [
        Finding(
            f"tenant/{t}",
            f"tenant {t} is at its limit with {len(ids)} request(s) waiting ({why[t]})",
            tenant=t,
            detail={"tenant": t, "waiting": ids},
        )
        for t, ids in sorted(waiting.items())
        if len(ids) >= max(rs.threshold, 1)
    ]


def job_failing(facts: Facts, rs: RuleSetting) -> list[Finding]:
    """A job (allocations of one name in one tenant; an unnamed one alone) failing `threshold`
    times in the last hour: failed ends and requeues after a lost process."""
    since = facts.now - timedelta(seconds=JOB_FAILING_WINDOW_S)
    groups: dict[tuple[str, str], list[EndSeen]] = defaultdict(list)
    for e in facts.ends:
        if e.at < since:
            continue
        key = (e.tenant, e.name) if e.name else (e.tenant, f"#{e.allocation_id}")
        groups[key].append(e)
    out = []
    for (tenant, name), ends in sorted(groups.items()):
        if len(ends) < max(rs.threshold, 1):
            continue
        last = ends[-1]
        subject = f"job/{tenant}/{name}" if not name.startswith("#") else f"allocation/{last.allocation_id}"
        what = f"job {name}" if not name.startswith("#") else f"allocation {last.allocation_id}"
        out.append(
            Finding(
                subject,
                f"{what} of {tenant} failing: {len(ends)} failures in the last hour (threshold "
                f"{rs.threshold:g})",
                tenant=tenant,
                detail={
                    "tenant": tenant,
                    "allocations": sorted({e.allocation_id for e in ends}),
                    "last_reason": last.reason,
                },
            )  # fmt: skip
        )
    return out


def leader_changed(facts: Facts, rs: RuleSetting) -> list[Finding]:
    """Holds for `threshold` seconds after this replica first saw a term other than the one the
    last such alert recorded (a first leader, term 1 with no alert before, is no change)."""
    if not facts.term_changed or _age(facts, facts.term_first_seen) > rs.threshold:
        return []
    before = "unknown" if facts.term_before is None else str(facts.term_before)
    return [
        Finding(
            "pool",
            f"the scheduling leader changed: term {facts.term} (was {before})",
            detail={"term": facts.term, "previous_term": facts.term_before},
        )
    ]


def audit_chain_broken(facts: Facts, rs: RuleSetting) -> list[Finding]:
    if facts.audit_problem is None:
        return []
    return [
        Finding(
            "pool",
            f"audit chain not intact: {facts.audit_problem}; run `cpool audit verify`",
            detail={"problem": facts.audit_problem},
        )
    ]


RULES: tuple[Rule, ...] = (
    Rule("node-suspect", "warning", "s", "A node's last heartbeat is older than the threshold "
         "(and younger than node-lost's).", node_suspect, lambda s: s.suspect_after_s, 0),
    Rule("node-lost", "critical", "s", "A node's last heartbeat is older than the threshold: the pool "
         "treats it as lost.", node_lost, lambda s: s.lost_after_s, 0),
    Rule("nodes-silent", "critical", "share", "More than the threshold share of the nodes are silent "
         "together: the pool declares none lost until more report (its own trouble is likelier).",
         nodes_silent, lambda s: s.lost_brake_share, 30),
    Rule("device-unhealthy", "critical", "", "A device's heartbeat reports it unhealthy (NVML errors, "
         "XID events).", device_unhealthy, lambda s: 0.0, 0),
    Rule("slice-memory-killed", "warning", "s", "An allocation was stopped by the node's GPU memory "
         "watchdog for going over its slice; firing for the threshold after the kill.",
         slice_memory_killed, lambda s: 900.0, 0),
    Rule("idle-devices", "warning", "%", "An allocation holds devices whose utilization stays at or "
         "below the threshold: devices paid for and unused.", idle_devices, lambda s: 0.0, 1800),
    Rule("fragmentation", "warning", "x", "A request waits although the free capacity summed over "
         "devices holds threshold times what it asks: free, but in pieces.", fragmentation,
         lambda s: 1.0, 600),
    Rule("tenant-at-limit", "warning", "requests", "A tenant is at its quota limit with at least "
         "threshold requests waiting for it.", tenant_at_limit, lambda s: 1.0, 300),
    Rule("job-failing", "warning", "failures/h", "A job (allocations of one name in a tenant) failed "
         "at least threshold times in the last hour.", job_failing, lambda s: 3.0, 0),
    Rule("leader-changed", "warning", "s", "Another control-plane replica (or a restarted one) took "
         "over scheduling; firing for the threshold after the change.", leader_changed,
         lambda s: 600.0, 0),
    Rule("audit-chain-broken", "critical", "", "The audit log's hash chain, seal or anchor does not "
         "check out.", audit_chain_broken, lambda s: 0.0, 0),
)  # fmt: skip
BY_NAME = {r.name: r for r in RULES}
