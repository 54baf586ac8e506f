"""Tenants' secrets: set from stdin, listed by name, never read back (jobs get them in their env)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints

from computepool.wire.allocations import SecretName, _no_nul
from computepool.wire.common import In, Name, Out

MAX_SECRET_BYTES = 32 * 1024


def _not_empty(value: str) -> str:
    if not value:
        raise ValueError("is empty: a secret needs a value")
    if len(value.encode()) > MAX_SECRET_BYTES:
        raise ValueError(f"is over {MAX_SECRET_BYTES} bytes (UTF-8)")
    return value


SecretValue = Annotated[
    str, StringConstraints(max_length=MAX_SECRET_BYTES), AfterValidator(_no_nul), AfterValidator(_not_empty)
]


class SecretSet(In):
    value: SecretValue = Field(description="The value, stored encrypted and never shown again.")
    tenant: Name | None = Field(default=None, description="Admins only: the tenant whose secret it is.")


class SecretOut(Out):
    name: SecretName
    tenant: str
    set_by: str = Field(description="Who set the current value (user:NAME).")
    created_at: datetime
    updated_at: datetime = Field(description="When the current value was set.")
