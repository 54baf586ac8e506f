"""The audit log as the API shows it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import Field

from computepool.wire.common import Out


class AuditOut(Out):
    seq: int
    time: datetime
    actor: str
    tenant: str | None
    action: str
    target: str
    outcome: str
    request_id: str
    detail: dict[str, Any]
    prev_hash: str
    hash: str


class AuditVerifyOut(Out):
    ok: bool
    records: int
    first_broken: int | None
    cause: str | None = Field(default=None, description="What is wrong, when ok is false.")
