"""The SQL of alerts: what the rules look at (nodes, devices, held work, recent ends), operators'
rule settings, alert rows, webhooks and the notification outbox."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import Session

from computepool.core.allocation import HOLDING
from computepool.store.models import (
    Alert,
    AlertDelivery,
    AlertRule,
    Allocation,
    AllocationEvent,
    Device,
    Node,
    Tenant,
    Webhook,
)

# --- what the rules look at -----------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSeen:
    name: str
    last_heartbeat_at: datetime


@dataclass(frozen=True)
class DeviceSeen:
    node: str
    index: int
    model: str
    health: str
    utilization_pct: float | None
    heartbeat_at: datetime  # the node's last heartbeat: when the figures above were said


@dataclass(frozen=True)
class HeldAlloc:
    """A bound or active allocation and the devices it holds."""

    id: int
    tenant: str
    owner: str
    name: str
    devices: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class EndSeen:
    """An event of an allocation's history: a failed end, or a requeue after its process was lost."""

    event_id: int
    allocation_id: int
    tenant: str
    owner: str
    name: str
    at: datetime
    state: str
    reason: str
    attempt: int


def nodes(s: Session) -> list[NodeSeen]:
    return [
        NodeSeen(n, at) for n, at in s.execute(select(Node.name, Node.last_heartbeat_at).order_by(Node.name))
    ]


def devices(s: Session) -> list[DeviceSeen]:
    stmt = (
        select(
            Node.name,
            Device.index,
            Device.model,
            Device.health,
            Device.utilization_pct,
            Node.last_heartbeat_at,
        )
        .join(Node, Device.node_id == Node.id)
        .order_by(Node.name, Device.index)
    )
    return [DeviceSeen(n, i, m, h or "", u, at) for n, i, m, h, u, at in s.execute(stmt)]


def held(s: Session) -> list[HeldAlloc]:
    stmt = (
        select(Allocation.id, Tenant.name, Allocation.owner, Allocation.name, Allocation.slices)
        .join(Tenant, Allocation.tenant_id == Tenant.id)
        .where(Allocation.state.in_(HOLDING))
        .order_by(Allocation.id)
    )
    out = []
    for i, tenant, owner, name, slices in s.execute(stmt):
        devs = tuple(dict.fromkeys((str(sl["node"]), int(sl["device_index"])) for sl in slices or []))
        out.append(HeldAlloc(i, tenant, owner, name, devs))
    return out


def ends_after(s: Session, after_id: int, since: datetime) -> tuple[list[EndSeen], int]:
    """Failed ends, and requeues after a lost process, written since `since` with an event id
    above `after_id` (oldest first); and the last event id, to read on from next time (a range
    of the primary key: a pass reads only the events written since the last). On PostgreSQL ids
    may commit out of order, so callers re-read a margin below `after_id` and drop repeats."""
    last = s.execute(select(func.max(AllocationEvent.id))).scalar_one_or_none() or 0
    if last <= after_id:
        return [], after_id
    stmt = (
        select(
            AllocationEvent.id,
            AllocationEvent.allocation_id,
            Tenant.name,
            Allocation.owner,
            Allocation.name,
            AllocationEvent.at,
            AllocationEvent.state,
            AllocationEvent.reason,
            AllocationEvent.attempt,
        )
        .join(Allocation, AllocationEvent.allocation_id == Allocation.id)
        .join(Tenant, Allocation.tenant_id == Tenant.id)
        .where(
            AllocationEvent.id > after_id,
            AllocationEvent.id <= last,
            AllocationEvent.at >= since,
            or_(
                AllocationEvent.state == "failed",
                (AllocationEvent.state == "pending") & AllocationEvent.reason.startswith("process lost"),
            ),
        )
        .order_by(AllocationEvent.id)
    )
    return [EndSeen(*row) for row in s.execute(stmt)], last


def lease_term_seen(s: Session) -> int | None:
    """The scheduler term the last leader-changed alert recorded (None: no such alert yet)."""
    stmt = select(Alert.detail).where(Alert.rule == "leader-changed").order_by(Alert.id.desc()).limit(1)
    detail = s.execute(stmt).scalar_one_or_none()
    term = detail.get("term") if isinstance(detail, dict) else None
    return int(term) if isinstance(term, int) else None


# --- rule settings --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuleSetting:
    enabled: bool
    threshold: float
    duration_s: int


def rule_settings(s: Session) -> dict[str, RuleSetting]:
    rows = s.execute(select(AlertRule.name, AlertRule.enabled, AlertRule.threshold, AlertRule.duration_s))
    return {n: RuleSetting(bool(e), float(t), int(d)) for n, e, t, d in rows}


def set_rule(s: Session, name: str, setting: RuleSetting, now: datetime) -> None:
    row = s.get(AlertRule, name)
    if row is None:
        s.add(
            AlertRule(
                name=name,
                enabled=setting.enabled,
                threshold=setting.threshold,
                duration_s=setting.duration_s,
                updated_at=now,
            )
        )
    else:
        row.enabled, row.threshold, row.duration_s = setting.enabled, setting.threshold, setting.duration_s
        row.updated_at = now
    s.flush()


# --- alerts ---------------------------------------------------------------------------------------


def firing(s: Session) -> dict[tuple[str, str], Alert]:
    """Firing alerts by (rule, subject); of two (never written so, but read defensively) the newest."""
    rows = s.scalars(select(Alert).where(Alert.state == "firing").order_by(Alert.id))
    return {(a.rule, a.subject): a for a in rows}


def fire(
    s: Session,
    rule: str,
    subject: str,
    tenant: str | None,
    severity: str,
    summary: str,
    detail: dict[str, Any],
    now: datetime,
) -> Alert:
    alert = Alert(
        rule=rule,
        subject=subject[:256],
        tenant=tenant,
        state="firing",
        severity=severity,
        summary=summary[:1024],
        detail=detail,
        since=now,
        resolved_at=None,
    )
    s.add(alert)
    s.flush()
    return alert


def list_alerts(
    s: Session, *, state: str | None, since: datetime | None, tenant: str | None, limit: int
) -> Sequence[Alert]:
    """Newest first. `since`: alerts firing at or after it, or resolved at or after it."""
    stmt = select(Alert)
    if state is not None:
        stmt = stmt.where(Alert.state == state)
    if since is not None:
        stmt = stmt.where(or_(Alert.since >= since, Alert.resolved_at >= since, Alert.state == "firing"))
    if tenant is not None:
        stmt = stmt.where(Alert.tenant == tenant)
    return s.scalars(stmt.order_by(Alert.id.desc()).limit(limit)).all()


# --- webhooks and the outbox ------------------------------------------------------------------------


def add_webhook(s: Session, url: str, created_by: str, salt: str, now: datetime) -> Webhook:
    hook = Webhook(url=url, created_by=created_by, created_at=now, salt=salt)
    s.add(hook)
    s.flush()
    return hook


def webhooks(s: Session) -> Sequence[Webhook]:
    return s.scalars(select(Webhook).order_by(Webhook.id)).all()


def get_webhook(s: Session, hook_id: int) -> Webhook | None:
    return s.get(Webhook, hook_id)


def delete_webhook(s: Session, hook: Webhook) -> None:
    s.execute(delete(AlertDelivery).where(AlertDelivery.webhook_id == hook.id))
    s.delete(hook)
    s.flush()


def enqueue(
    s: Session, alert_id: int, event: str, hook_ids: Sequence[int], mail: bool, now: datetime
) -> None:
    """One pending delivery of `event` per webhook, and one by mail when mail is set up."""
    rows: list[dict[str, Any]] = [{"channel": "webhook", "webhook_id": h} for h in hook_ids]
    if mail:
        rows.append({"channel": "mail", "webhook_id": None})
    for r in rows:
        s.add(
            AlertDelivery(
                alert_id=alert_id,
                event=event,
                state="pending",
                attempts=0,
                next_at=now,
                last_error="",
                created_at=now,
                **r,
            )
        )
    s.flush()


@dataclass(frozen=True)
class Due:
    """A pending delivery whose time has come, with what sending it needs."""

    id: int
    alert_id: int
    event: str
    channel: str
    webhook_id: int | None
    url: str | None
    salt: str | None
    attempts: int
    next_at: datetime


def due(s: Session, now: datetime, limit: int) -> list[Due]:
    stmt = (
        select(
            AlertDelivery.id,
            AlertDelivery.alert_id,
            AlertDelivery.event,
            AlertDelivery.channel,
            AlertDelivery.webhook_id,
            Webhook.url,
            Webhook.salt,
            AlertDelivery.attempts,
            AlertDelivery.next_at,
        )
        .outerjoin(Webhook, AlertDelivery.webhook_id == Webhook.id)
        .where(AlertDelivery.state == "pending", AlertDelivery.next_at <= now)
        .order_by(AlertDelivery.next_at, AlertDelivery.id)
        .limit(limit)
    )
    return [Due(*row) for row in s.execute(stmt)]


def claim(s: Session, d: Due, now: datetime, until: datetime) -> bool:
    """Take a due delivery for sending until `until`: a compare-and-set (still pending, still due,
    same attempt count), so of replicas reading it at once one wins; a sender that dies leaves it
    to be taken again after `until`."""
    stmt = (
        update(AlertDelivery)
        .where(
            AlertDelivery.id == d.id,
            AlertDelivery.state == "pending",
            AlertDelivery.attempts == d.attempts,
            AlertDelivery.next_at <= now,
        )
        .values(next_at=until)
        .execution_options(synchronize_session=False)
    )
    return bool(s.execute(stmt).rowcount == 1)  # type: ignore[attr-defined]


def finish(s: Session, d: Due, claimed_until: datetime, state: str, next_at: datetime, error: str) -> bool:
    """Record a try of `d` claimed until `claimed_until`, if that claim is still ours: a sender
    slower than its claim finds the delivery taken again (or its webhook deleted) and records
    nothing."""
    stmt = (
        update(AlertDelivery)
        .where(
            AlertDelivery.id == d.id,
            AlertDelivery.state == "pending",
            AlertDelivery.attempts == d.attempts,
            AlertDelivery.next_at == claimed_until,
        )
        .values(state=state, attempts=d.attempts + 1, next_at=next_at, last_error=error[:1024])
        .execution_options(synchronize_session=False)
    )
    return bool(s.execute(stmt).rowcount == 1)  # type: ignore[attr-defined]


def prune(s: Session, before: datetime) -> tuple[int, int]:
    """Delete deliveries sent or given up before `before`, then alerts resolved before it that have
    no delivery left pending; the newest leader-changed alert stays (it names the last term seen).
    Returns (alerts, deliveries) deleted."""
    gone = s.execute(
        delete(AlertDelivery)
        .where(AlertDelivery.state.in_(("sent", "failed")), AlertDelivery.next_at < before)
        .execution_options(synchronize_session=False)
    ).rowcount  # type: ignore[attr-defined]
    keep = select(func.max(Alert.id)).where(Alert.rule == "leader-changed").scalar_subquery()
    pending = select(AlertDelivery.alert_id).where(AlertDelivery.state == "pending")
    old = select(Alert.id).where(
        Alert.state == "resolved",
        Alert.resolved_at < before,
        Alert.id.not_in(pending),
        or_(Alert.rule != "leader-changed", Alert.id != keep),
    )
    ids = list(s.scalars(old))
    for i in range(0, len(ids), 500):
        chunk = ids[i : i + 500]
        gone += s.execute(
            delete(AlertDelivery)
            .where(AlertDelivery.alert_id.in_(chunk))
            .execution_options(synchronize_session=False)
        ).rowcount  # type: ignore[attr-defined]
        s.execute(delete(Alert).where(Alert.id.in_(chunk)).execution_options(synchronize_session=False))
    return len(ids), int(gone)


def deliveries(s: Session, alert_id: int | None = None) -> Sequence[AlertDelivery]:
    stmt = select(AlertDelivery).order_by(AlertDelivery.id)
    if alert_id is not None:
        stmt = stmt.where(AlertDelivery.alert_id == alert_id)
    return s.scalars(stmt).all()
