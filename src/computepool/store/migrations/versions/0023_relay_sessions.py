"""Relay sessions: a user's shell or tunnelled connection into a running job, relayed between the
user's socket and the one its node's agent dials back (`cpool exec`, `cpool forward`).

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from computepool.store.types import UTCDateTime

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "relay_sessions",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "allocation_id",
            sa.Integer(),
            sa.ForeignKey("allocations.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(63), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("command", sa.JSON(), nullable=False),
        sa.Column("tty", sa.Boolean(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("cols", sa.Integer(), nullable=False),
        sa.Column("port", sa.Integer(), nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.Column("client_secret_hash", sa.String(64), nullable=False),
        sa.Column("node_secret", sa.String(64), nullable=False),
        sa.Column("replica", sa.String(1024), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
        sa.Column("ended_at", UTCDateTime(), nullable=True),
        sqlite_autoincrement=True,  # ids never reused: agents ask for the sessions past one they saw
    )
    op.create_index("ix_relay_sessions_allocation_id", "relay_sessions", ["allocation_id"])
    op.create_index("ix_relay_sessions_node", "relay_sessions", ["node"])
    op.create_index("ix_relay_sessions_state", "relay_sessions", ["state"])


def downgrade() -> None:
    op.drop_table("relay_sessions")
