"""Prometheus metrics on the app's own registry (no global state), served at /metrics to admins.

Pool gauges (devices, tenants, pending work) are read from the database at scrape time, so
every replica reports the same numbers; latency histograms are this process's own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from computepool.server import scheduling
from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.policy import Action
from computepool.server.settings import ServerSettings
from computepool.store import allocations as alloc_store
from computepool.store.db import Database

CYCLE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class PoolCollector(Collector):
    """Device capacity and allocation, tenant usage against quota, pending work per tenant."""

    def __init__(self, db: Database, settings: ServerSettings) -> None:
        self.db = db
        self.settings = settings

    def collect(self) -> Iterator[Metric]:
        with self.db.read() as s:
            snap = scheduling.load_snapshot(s, self.settings)
            pending = alloc_store.count_by(s, "pending")
        dev_labels = ["node", "device", "model"]
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


@router.get("/metrics", summary="Prometheus metrics (admin)", response_class=Response)
def metrics(request: Request, ctx: Annotated[Ctx, Depends(requires(Action.METRICS_READ))]) -> Response:
    m: Metrics = request.app.state.metrics
    return Response(m.render(), media_type=CONTENT_TYPE_LATEST)
