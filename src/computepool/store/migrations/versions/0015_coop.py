"""Cooperative inference: the peers each node's discovery found (and rejected), the measured speed
of a model on each candidate device, each cooperative service's plan, and which allocations are a
cooperative service's llama.cpp RPC servers.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from computepool.store.types import UTCDateTime

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_peers",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("observer", sa.String(63), nullable=False),
        sa.Column("peer_key", sa.String(160), nullable=False),
        sa.Column("node_id", sa.String(63), nullable=True),
        sa.Column("instance", sa.String(64), nullable=False, server_default=""),
        sa.Column("address", sa.String(253), nullable=False, server_default=""),
        sa.Column("port", sa.Integer(), nullable=True),
        sa.Column("devices", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(512), nullable=False, server_default=""),
        sa.Column("source", sa.String(16), nullable=False, server_default=""),
        sa.Column("rtt_ms", sa.Float(), nullable=True),
        sa.Column("bandwidth_mbps", sa.Float(), nullable=True),
        sa.Column("last_seen", UTCDateTime(), nullable=False),
        sa.Column("reported_at", UTCDateTime(), nullable=False),
        sa.UniqueConstraint("observer", "peer_key", name="uq_node_peers_observer_key"),
    )
    op.create_table(
        "coop_measurements",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("model_key", sa.String(128), nullable=False),
        sa.Column("node", sa.String(63), nullable=False),
        sa.Column("device", sa.String(32), nullable=False),
        sa.Column("tokens_per_s", sa.Float(), nullable=False),
        sa.Column("memory_mib", sa.Integer(), nullable=False),
        sa.Column("measured_at", UTCDateTime(), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.UniqueConstraint("model_key", "node", "device", name="uq_coop_measurements_key"),
    )
    op.create_table(
        "coop_plans",
        sa.Column(
            "service_id", sa.Integer(), sa.ForeignKey("services.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False, server_default=""),
        sa.Column("attempt", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )
    with op.batch_alter_table("allocations") as b:
        b.add_column(sa.Column("coop_service_id", sa.Integer(), nullable=True))
        b.add_column(sa.Column("coop_role", sa.String(16), nullable=True))
    op.create_index("ix_allocations_coop_service_id", "allocations", ["coop_service_id"])


def downgrade() -> None:
    op.drop_index("ix_allocations_coop_service_id", table_name="allocations")
    with op.batch_alter_table("allocations") as b:
        b.drop_column("coop_role")
        b.drop_column("coop_service_id")
    op.drop_table("coop_plans")
    op.drop_table("coop_measurements")
    op.drop_table("node_peers")
