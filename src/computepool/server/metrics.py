"""Prometheus metrics on the app's own registry (no global state), served at /metrics to admins
and to monitoring systems' `scraper` users.

Pool gauges (devices, tenants, pending work, what heartbeats carry, node states, firing alerts)
are read from the database at scrape time in one read transaction of a few whole-table queries,
so every replica reports the same numbers and a scrape costs the same whatever the pool's size;
latency histograms are this process's own. What a device last reported (utilization, memory,
power, energy, health) is left out once its node is lost: it no longer says anything true.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import select
from sqlalchemy.orm import Session

from computepool.server import scheduling
from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.policy import Action
from computepool.server.settings import ServerSettings
from computepool.store import allocations as alloc_store
from computepool.store import lease
from computepool.store.db import Database, db_now
from computepool.store.models import Alert, Device, Node

CYCLE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
NODE_STATES = ("ready", "suspect", "lost")
DEV_LABELS = ["node", "device", "model"]


def _telemetry(s: Session) -> Sequence[Any]:
    """(node, last heartbeat, device index, model, utilization, used memory, power, energy,
    health) for every device; a node without devices comes once, its device fields None."""
    stmt = (
        select(
            Node.name,
            Node.last_heartbeat_at,
            Device.index,
            Device.model,
            Device.utilization_pct,
            Device.used_memory_mib,
            Device.power_w,
            Device.energy_j,
            Device.health,
        )
        .outerjoin(Device, Device.node_id == Node.id)
        .order_by(Node.name, Device.index)
    )
    return s.execute(stmt).all()


def _firing(s: Session) -> Sequence[Any]:
    """(rule, subject, severity) of every firing alert."""
    stmt = select(Alert.rule, Alert.subject, Alert.severity).where(Alert.state == "firing")
    return s.execute(stmt.order_by(Alert.rule, Alert.subject)).all()


class PoolCollector(Collector):
    """Device capacity and allocation, tenant usage against quota, pending work per tenant, what
    heartbeats carry per device, node states and firing alerts: one read, whatever the pool's size."""

    def __init__(self, db: Database, settings: ServerSettings) -> None:
        self.db = db
        self.settings = settings

    def collect(self) -> Iterator[Metric]:
        with self.db.read() as s:  # node states as the scheduling leader judges them
            since = lease.observed_since(s, db_now(s))
            snap = scheduling.load_snapshot(s, self.settings, observed_since=since)
            pending = alloc_store.count_by(s, "pending")
            telemetry = _telemetry(s)
            firing = _firing(s)
        yield from self._allocation(snap, pending)
        yield from self._brake(snap)
        states = {n.name: n.state for n in snap.nodes}
        yield from self._devices(telemetry, snap.now or datetime.now(UTC), states)
        yield from self._alerts(firing)

    def _allocation(self, snap: scheduling.Snapshot, pending: dict[str, int]) -> Iterator[Metric]:
        """Capacity and what slices hold, per device; tenants against quota; pending work."""
        dev_labels = DEV_LABELS
        cap = GaugeMetricFamily(
            "cpool_device_capacity_milli", "Compute of a device (1000 = whole).", labels=dev_labels
        )
        alloc = GaugeMetricFamily(
            "cpool_device_allocated_milli", "Compute given to slices.", labels=dev_labels
        )
        mem = GaugeMetricFamily("cpool_device_memory_mib", "Memory of a device.", labels=dev_labels)
        mem_alloc = GaugeMetricFamily(
            "cpool_device_allocated_memory_mib", "Device memory given to slices.", labels=dev_labels
        )
        used_milli: Counter[tuple[str, int]] = Counter()
        used_mem: Counter[tuple[str, int]] = Counter()
        usage: dict[str, Counter[tuple[str, str]]] = {t: Counter() for t in snap.weights}
        models = {(n.name, d.index): d.model for n in snap.nodes for d in n.devices}
        for a in snap.live:
            if a.state not in alloc_store.HOLDING:
                continue
            for sl in a.slices:
                used_milli[(sl["node"], sl["device_index"])] += sl["compute_milli"]
                used_mem[(sl["node"], sl["device_index"])] += sl["memory_mib"]
            u = scheduling.slices_usage(a.slices, lambda n, i: models.get((n, i)))
            u.update(scheduling.host_usage(a.core, len(a.nodes)))
            usage.setdefault(a.tenant, Counter()).update(u)
        for n in snap.nodes:
            for d in n.devices:
                labels = [n.name, str(d.index), d.model]
                cap.add_metric(labels, d.compute_milli)
                alloc.add_metric(labels, used_milli[(n.name, d.index)])
                mem.add_metric(labels, d.memory_mib)
                mem_alloc.add_metric(labels, used_mem[(n.name, d.index)])
        yield from (cap, alloc, mem, mem_alloc)
        t_labels = ["tenant", "model", "resource"]
        used = GaugeMetricFamily("cpool_tenant_usage", "What a tenant holds, per resource.", labels=t_labels)
        guar = GaugeMetricFamily("cpool_tenant_guaranteed", "A tenant's guaranteed quota.", labels=t_labels)
        lim = GaugeMetricFamily("cpool_tenant_limit", "A tenant's quota limit.", labels=t_labels)
        for tenant in sorted(usage):
            quota = snap.quotas.get(tenant, {})
            for model, res in sorted(set(usage[tenant]) | set(quota)):
                labels = [tenant, model, res]
                used.add_metric(labels, usage[tenant][(model, res)])
                if (model, res) in quota:
                    guar.add_metric(labels, quota[(model, res)][0])
                    lim.add_metric(labels, quota[(model, res)][1])
        yield from (used, guar, lim)
        pend = GaugeMetricFamily(
            "cpool_pending_allocations", "Allocations waiting, per tenant.", labels=["tenant"]
        )
        for tenant in sorted(snap.weights):
            pend.add_metric([tenant], pending.get(tenant, 0))
        yield pend

    def _brake(self, snap: scheduling.Snapshot) -> Iterator[Metric]:
        """How many nodes are silent, and whether that many stop the pool declaring any lost."""
        silent = GaugeMetricFamily(
            "cpool_nodes_silent", "Nodes without a heartbeat for suspect_after_s (suspect or lost)."
        )
        silent.add_metric([], snap.silent)
        brake = GaugeMetricFamily(
            "cpool_node_lost_brake",
            "1 while more than lost_brake_share of the nodes are silent together: no node is declared lost.",
        )
        brake.add_metric([], 1.0 if snap.braked else 0.0)
        yield from (silent, brake)

    def _devices(self, rows: Sequence[Any], now: datetime, states: dict[str, str]) -> Iterator[Metric]:
        """What heartbeats carry, per device, and each node's state (`states`: as the scheduling
        leader judges it) and heartbeat age."""
        util = GaugeMetricFamily(
            "cpool_device_utilization_percent",
            "Device utilization as its last heartbeat reported it (absent where the vendor cannot tell).",
            labels=DEV_LABELS,
        )
        used = GaugeMetricFamily(
            "cpool_device_memory_used_mib", "Device memory in use, as last reported.", labels=DEV_LABELS
        )
        power = GaugeMetricFamily(
            "cpool_device_power_watts", "Device power draw, as last reported.", labels=DEV_LABELS
        )
        energy = GaugeMetricFamily(
            "cpool_device_energy_joules",
            "The device's total-energy counter as reported (J; resets when its driver or agent restarts).",
            labels=DEV_LABELS,
        )
        healthy = GaugeMetricFamily(
            "cpool_device_healthy",
            "1 while the device reports no NVML error or critical XID event, else 0.",
            labels=DEV_LABELS,
        )
        state = GaugeMetricFamily(
            "cpool_node_state",
            "1 for the node's current state, as the scheduler judges it (silence counted from no "
            "earlier than the leader began to watch; none lost while the brake holds).",
            labels=["node", "state"],
        )
        age = GaugeMetricFamily(
            "cpool_node_heartbeat_age_seconds", "Seconds since the node's last heartbeat.", labels=["node"]
        )
        seen: set[str] = set()
        for name, beat, index, model, util_pct, used_mib, watts, joules, health in rows:
            age_s = max(0.0, (now - beat).total_seconds())
            current = states.get(name) or scheduling.node_state(age_s, self.settings)
            if name not in seen:
                seen.add(name)
                age.add_metric([name], age_s)
                for st in NODE_STATES:
                    state.add_metric([name, st], 1.0 if st == current else 0.0)
            if index is None or current == "lost":
                continue
            labels = [name, str(index), model]
            for family, value in ((util, util_pct), (used, used_mib), (power, watts), (energy, joules)):
                if value is not None:
                    family.add_metric(labels, value)
            healthy.add_metric(labels, 0.0 if health else 1.0)
        yield from (util, used, power, energy, healthy, state, age)

    def _alerts(self, firing: Sequence[Any]) -> Iterator[Metric]:
        """Firing alerts, counted per rule and one series each (the alerts table is the truth)."""
        count = GaugeMetricFamily(
            "cpool_alerts_firing", "Firing alerts per rule and severity.", labels=["rule", "severity"]
        )
        each = GaugeMetricFamily(
            "cpool_alert_firing", "1 for each firing alert.", labels=["rule", "subject", "severity"]
        )
        per_rule: Counter[tuple[str, str]] = Counter()
        for rule, subject, severity in firing:
            per_rule[(rule, severity)] += 1
            each.add_metric([rule, subject, severity], 1.0)
        for (rule, severity), n in sorted(per_rule.items()):
            count.add_metric([rule, severity], n)
        yield from (count, each)


class Metrics:
    """The registry and the histograms the app and the scheduling loop observe."""

    def __init__(self, db: Database, settings: ServerSettings) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.cycle_seconds = Histogram(
            "cpool_scheduling_cycle_seconds",
            "Duration of a scheduling cycle (lease, snapshot, decisions, commit).",
            buckets=CYCLE_BUCKETS,
            registry=self.registry,
        )
        self.api_seconds = Histogram(
            "cpool_api_request_seconds",
            "API answer latency by route template and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.audit_intact = Gauge(
            "cpool_audit_chain_intact",
            "1 while the audit chain checks out (at start, then its head each second); 0 once it does not.",
            registry=self.registry,
        )
        self.registry.register(PoolCollector(db, settings))

    def render(self) -> bytes:
        return generate_latest(self.registry)


router = APIRouter(tags=["metrics"])


@router.get("/metrics", summary="Prometheus metrics (admin and scraper users)", response_class=Response)
def metrics(request: Request, ctx: Annotated[Ctx, Depends(requires(Action.METRICS_READ))]) -> Response:
    m: Metrics = request.app.state.metrics
    return Response(m.render(), media_type=CONTENT_TYPE_LATEST)
