"""Model services: services, their replicas (allocations with a service), the gateways' load
reports, usage per token and per-tenant gateway rate limits.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from computepool.store.types import UTCDateTime

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "services",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="RESTRICT"), nullable=False
        ),
        sa.Column("owner", sa.String(63), nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("desired", sa.Integer(), nullable=False),
        sa.Column("reason", sa.String(1024), nullable=False, server_default=""),
        sa.Column("last_request_at", UTCDateTime(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.Column("deleted_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_services_tenant_name", "services", ["tenant_id", "name"])
    with op.batch_alter_table("allocations") as b:
        b.add_column(sa.Column("service_id", sa.Integer(), nullable=True))
        b.add_column(sa.Column("service_generation", sa.Integer(), nullable=True))
        b.add_column(sa.Column("service_port", sa.Integer(), nullable=True))
        b.add_column(sa.Column("replica_state", sa.String(16), nullable=True))
        b.add_column(sa.Column("replica_since", UTCDateTime(), nullable=True))
    op.create_index("ix_allocations_service_id", "allocations", ["service_id"])
    op.create_table(
        "gateway_load",
        sa.Column("gateway", sa.String(128), primary_key=True),
        sa.Column(
            "service_id", sa.Integer(), sa.ForeignKey("services.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("inflight", sa.Integer(), nullable=False),
        sa.Column("queued", sa.Integer(), nullable=False),
        sa.Column("replicas", sa.JSON(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "gateway_usage",
        sa.Column(
            "tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("user", sa.String(63), primary_key=True),
        sa.Column("token_id", sa.String(32), primary_key=True),
        sa.Column("service", sa.String(63), primary_key=True),
        sa.Column("hour", UTCDateTime(), primary_key=True),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("failed", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "gateway_limits",
        sa.Column(
            "tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("requests_per_minute", sa.Integer(), nullable=False),
        sa.Column("burst", sa.Integer(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("gateway_limits")
    op.drop_table("gateway_usage")
    op.drop_table("gateway_load")
    op.drop_index("ix_allocations_service_id", "allocations")
    with op.batch_alter_table("allocations") as b:
        for col in ("replica_since", "replica_state", "service_port", "service_generation", "service_id"):
            b.drop_column(col)
    op.drop_index("ix_services_tenant_name", "services")
    op.drop_table("services")
