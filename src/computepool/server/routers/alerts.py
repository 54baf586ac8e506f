"""Alerts, alert rules and webhooks."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query

from computepool.server.alerts import api
from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.policy import Action
from computepool.wire.alerts import (
    AlertOut,
    AlertRuleIn,
    AlertRuleOut,
    WebhookCreated,
    WebhookIn,
    WebhookOut,
)
from computepool.wire.common import Items

router = APIRouter(tags=["alerts"])


@router.get("/alerts", summary="Firing and resolved alerts, newest first (a tenant's users: theirs)")
def list_alerts(
    ctx: Annotated[Ctx, Depends(requires(Action.ALERT_LIST))],
    state: Annotated[Literal["firing", "resolved", "all"], Query(description="Which alerts.")] = "all",
    since: Annotated[
        str | None, Query(max_length=64, description="Only alerts active since: 30m, 12h, 7d or an ISO time.")
    ] = None,
) -> Items[AlertOut]:
    return api.list_alerts(ctx, state, since)


@router.get("/alert-rules", summary="The alert rules with their thresholds and durations")
def list_rules(ctx: Annotated[Ctx, Depends(requires(Action.ALERT_RULE_LIST))]) -> Items[AlertRuleOut]:
    return api.list_rules(ctx)


@router.put("/alert-rules/{name}", summary="Enable, disable or retune a rule (admin)")
def set_rule(
    name: Annotated[str, Path(max_length=64, description="A rule's name, e.g. node-lost.")],
    body: AlertRuleIn,
    ctx: Annotated[Ctx, Depends(requires(Action.ALERT_RULE_SET))],
) -> AlertRuleOut:
    return api.set_rule(ctx, name, body)


@router.post(
    "/webhooks",
    status_code=201,
    summary="Add a webhook; its signing secret is in this answer only (admin)",
)
def create_webhook(
    body: WebhookIn, ctx: Annotated[Ctx, Depends(requires(Action.WEBHOOK_CREATE))]
) -> WebhookCreated:
    return api.create_webhook(ctx, body)


@router.get("/webhooks", summary="The webhooks alerts are sent to (admin)")
def list_webhooks(ctx: Annotated[Ctx, Depends(requires(Action.WEBHOOK_LIST))]) -> Items[WebhookOut]:
    return api.list_webhooks(ctx)


@router.delete("/webhooks/{webhook_id}", summary="Remove a webhook (admin)")
def delete_webhook(
    webhook_id: int, ctx: Annotated[Ctx, Depends(requires(Action.WEBHOOK_DELETE))]
) -> WebhookOut:
    return api.delete_webhook(ctx, webhook_id)
