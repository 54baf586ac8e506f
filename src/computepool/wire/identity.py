"""Tenants, users and API tokens."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from computepool.wire.common import MAX_EXPIRES_S, In, Name, Out

UserRole = Literal["admin", "tenant-admin", "member", "viewer", "scraper"]


class TenantCreate(In):
    name: Name
    weight: float = Field(
        default=1.0, gt=0, le=1_000_000, allow_inf_nan=False, description="Fair-share weight (relative)."
    )


class TenantOut(Out):
    name: str
    weight: float = Field(description="Fair-share weight (relative).")
    created_at: datetime


class UserCreate(In):
    name: Name = Field(description="Unique in the whole pool.")
    tenant: Name = Field(description="The tenant the user belongs to.")
    role: UserRole = Field(
        description="admin (whole pool), tenant-admin, member, viewer (read-only) or scraper (reads "
        "/metrics only, for Prometheus)."
    )


class UserOut(Out):
    name: str
    tenant: str
    role: str
    created_at: datetime


class TokenCreate(In):
    user: Name | None = Field(default=None, description="Whose token (default: the caller).")
    name: str = Field(default="", max_length=63, pattern=r"^[\w .:@-]*$", description="A label for people.")
    expires_in_s: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=MAX_EXPIRES_S,
        description="Lifetime in seconds; none = no expiry.",
    )


class TokenCreated(Out):
    id: str = Field(description="Public id of the token (used to list and revoke it).")
    token: str = Field(description="The bearer secret `<id>.<secret>`; shown only in this answer.")
    user: str
    expires_at: datetime | None


class TokenOut(Out):
    id: str
    name: str
    user: str
    created_by: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class WhoAmI(Out):
    name: str = Field(description="User name, or node name for a node credential.")
    role: str
    tenant: str | None
    node: str | None
    token_id: str
