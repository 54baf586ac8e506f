"""What the alerts API does: list alerts (a tenant's users see their tenant's only), show and change
rules, and manage webhooks (admins). Changes are audited in the same transaction."""

from __future__ import annotations

from datetime import datetime

from computepool.server.alerts import rules
from computepool.server.alerts.engine import effective
from computepool.server.alerts.notify import alert_out
from computepool.server.alerts.redact import url_origin
from computepool.server.alerts.signing import load_or_create_key, new_salt, webhook_secret
from computepool.server.context import Ctx
from computepool.server.errors import NotFound
from computepool.server.logic.audit import record
from computepool.server.logic.usage import parse_when
from computepool.server.policy import authorize
from computepool.store import alerts as store
from computepool.store.alerts import RuleSetting
from computepool.store.db import db_now
from computepool.wire.alerts import (
    AlertOut,
    AlertRuleIn,
    AlertRuleOut,
    WebhookCreated,
    WebhookIn,
    WebhookOut,
)
from computepool.wire.common import MAX_ID, Items

MAX_ALERTS = 1000


def parse_since(text: str | None, now: datetime) -> datetime | None:
    """`30m`, `12h`, `7d` (that long ago) or an ISO time (UTC when it has no zone); None: no bound.
    Read as the usage API reads it, so a time out of range answers 422 naming `since`."""
    if text is None or not text.strip():
        return None
    return parse_when(text, now, "", "since")


def list_alerts(ctx: Ctx, state: str, since: str | None) -> Items[AlertOut]:
    scope = authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        after = parse_since(since, db_now(s))
        rows = store.list_alerts(
            s, state=None if state == "all" else state, since=after, tenant=scope.tenant, limit=MAX_ALERTS
        )
        return Items[AlertOut](items=[alert_out(a) for a in rows])


def _rule_out(rule: rules.Rule, rs: RuleSetting) -> AlertRuleOut:
    return AlertRuleOut(
        name=rule.name,
        enabled=rs.enabled,
        threshold=rs.threshold,
        duration_s=rs.duration_s,
        unit=rule.unit,
        description=rule.description,
    )


def list_rules(ctx: Ctx) -> Items[AlertRuleOut]:
    authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        setting = effective(ctx.settings, store.rule_settings(s))
    return Items[AlertRuleOut](items=[_rule_out(r, setting[r.name]) for r in rules.RULES])


def set_rule(ctx: Ctx, name: str, body: AlertRuleIn) -> AlertRuleOut:
    authorize(ctx.caller(), ctx.action)
    rule = rules.BY_NAME.get(name)
    if rule is None:
        raise NotFound.of("alert rule", name)
    with ctx.db.write() as s:
        now = db_now(s)
        was = effective(ctx.settings, store.rule_settings(s))[name]
        new = RuleSetting(
            was.enabled if body.enabled is None else body.enabled,
            was.threshold if body.threshold is None else float(body.threshold),
            was.duration_s if body.duration_s is None else body.duration_s,
        )
        store.set_rule(s, name, new, now)
        record(
            s,
            ctx,
            f"alert-rule:{name}",
            detail={"enabled": new.enabled, "threshold": new.threshold, "duration_s": new.duration_s},
            now=now,
        )
    return _rule_out(rule, new)


def create_webhook(ctx: Ctx, body: WebhookIn) -> WebhookCreated:
    caller = ctx.caller()
    authorize(caller, ctx.action)
    key = load_or_create_key(ctx.settings.webhook_key_path)
    with ctx.db.write() as s:
        now = db_now(s)
        hook = store.add_webhook(s, body.url, caller.actor, new_salt(), now)
        # never the secret, nor the whole URL (it may hold a token): its origin
        record(s, ctx, f"webhook:{hook.id}", detail={"url": url_origin(body.url)}, now=now)
        return WebhookCreated(
            id=hook.id,
            url=hook.url,
            secret=webhook_secret(key, hook.id, hook.salt),
            created_at=hook.created_at,
        )


def list_webhooks(ctx: Ctx) -> Items[WebhookOut]:
    authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        return Items[WebhookOut](
            items=[
                WebhookOut(id=h.id, url=h.url, created_by=h.created_by, created_at=h.created_at)
                for h in store.webhooks(s)
            ]
        )


def delete_webhook(ctx: Ctx, hook_id: int) -> WebhookOut:
    authorize(ctx.caller(), ctx.action)
    if not 1 <= hook_id <= MAX_ID:
        raise NotFound.of("webhook", hook_id)
    with ctx.db.write() as s:
        hook = store.get_webhook(s, hook_id)
        if hook is None:
            raise NotFound.of("webhook", hook_id)
        out = WebhookOut(id=hook.id, url=hook.url, created_by=hook.created_by, created_at=hook.created_at)
        store.delete_webhook(s, hook)
        record(s, ctx, f"webhook:{hook_id}", detail={"url": url_origin(out.url)}, now=db_now(s))
    return out
