"""Allocations, their events, node placements, job logs and the scheduler lease.

Revision ID: 0002
Revises: 0001
Create Date: 2025-01-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from computepool.store.types import UTCDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "allocations",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column(
            "tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="RESTRICT"), nullable=False
        ),
        sa.Column("owner", sa.String(63), nullable=False),
        sa.Column("idempotency_key", sa.String(128), nullable=True),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("command", sa.JSON(), nullable=True),
        sa.Column("env", sa.JSON(), nullable=True),
        sa.Column("restartable", sa.Boolean(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(1024), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("term", sa.BigInteger(), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("slices", sa.JSON(), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("bound_at", UTCDateTime(), nullable=True),
        sa.Column("started_at", UTCDateTime(), nullable=True),
        sa.Column("ended_at", UTCDateTime(), nullable=True),
        sa.UniqueConstraint("owner", "idempotency_key", name="uq_allocations_owner_key"),
    )
    op.create_index("ix_allocations_tenant_id", "allocations", ["tenant_id"])
    op.create_index("ix_allocations_state", "allocations", ["state"])
    op.create_table(
        "allocation_events",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "allocation_id",
            sa.Integer(),
            sa.ForeignKey("allocations.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(1024), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("term", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_allocation_events_allocation_id", "allocation_events", ["allocation_id"])
    op.create_table(
        "allocation_nodes",
        sa.Column(
            "allocation_id",
            sa.Integer(),
            sa.ForeignKey("allocations.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("node", sa.String(63), primary_key=True),
    )
    op.create_index("ix_allocation_nodes_node", "allocation_nodes", ["node"])
    op.create_table(
        "allocation_logs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "allocation_id",
            sa.Integer(),
            sa.ForeignKey("allocations.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("stream", sa.String(8), nullable=False),
        sa.Column("stream_offset", sa.BigInteger(), nullable=False),
        sa.Column("pos", sa.BigInteger(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.Text(), nullable=False),
    )
    op.create_index("ix_allocation_logs_allocation_id", "allocation_logs", ["allocation_id"])
    op.create_table(
        "scheduler_lease",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("holder", sa.String(64), nullable=False),
        sa.Column("term", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    for table in (
        "scheduler_lease",
        "allocation_logs",
        "allocation_nodes",
        "allocation_events",
        "allocations",
    ):
        op.drop_table(table)
