"""Alerts, alert rules and webhooks on the wire (the API, the webhook body, the CLI's --json)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from computepool.core.states import AlertState
from computepool.wire.common import In, Out

Severity = Literal["warning", "critical"]
MAX_RULE_DURATION_S = 30 * 86400
MAX_THRESHOLD = 1e9


class AlertOut(Out):
    id: int
    rule: str = Field(description="The rule that fired, e.g. node-lost.")
    state: AlertState
    severity: Severity
    since: datetime = Field(description="When it fired.")
    resolved_at: datetime | None
    subject: str = Field(description="What it is about: node/NAME, device/NODE/IDX, allocation/ID, …")
    tenant: str | None = Field(description="The tenant the subject belongs to (None: the pool's).")
    summary: str
    detail: dict[str, Any]


class AlertRuleOut(Out):
    name: str
    enabled: bool
    threshold: float
    duration_s: int = Field(description="How long the condition must hold before the alert fires.")
    unit: str = Field(description="Unit of the threshold (s, %, …; empty where the rule has none).")
    description: str


class AlertRuleIn(In):
    """Change a rule; fields left out keep their current value."""

    enabled: bool | None = None
    threshold: float | None = Field(default=None, ge=0, le=MAX_THRESHOLD, allow_inf_nan=False)
    duration_s: int | None = Field(default=None, strict=True, ge=0, le=MAX_RULE_DURATION_S)


class WebhookIn(In):
    url: str = Field(max_length=2048, description="http(s) URL the notifications are POSTed to.")

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        try:
            parts = urlsplit(v)
        except ValueError:
            raise ValueError(f"not a URL: {v!r}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http:// or https:// URL with a host, got {v!r}")
        if any(c.isspace() for c in v):
            raise ValueError("a URL has no spaces")
        try:
            port = parts.port  # read lazily: letters or a number past 65535 fail only here
        except ValueError:
            raise ValueError(f"the port must be a number from 1 to 65535, in {v!r}") from None
        if port == 0:
            raise ValueError(f"the port must be a number from 1 to 65535, in {v!r}")
        return v


class WebhookOut(Out):
    id: int
    url: str
    created_by: str
    created_at: datetime


class WebhookCreated(Out):
    id: int
    url: str
    secret: str = Field(description="Signs its notifications; shown only now.")
    created_at: datetime


class WebhookBody(Out):
    """What a webhook receives."""

    event: AlertState
    alert: AlertOut
