"""Usage, energy and alerts: device power and health, the usage ledger and its clock, device
history, prices, alert rules and alerts, webhooks and the notification outbox.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from computepool.store.types import UTCDateTime

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("devices") as b:
        b.add_column(sa.Column("power_w", sa.Float(), nullable=True))
        b.add_column(sa.Column("energy_j", sa.Float(), nullable=True))
        b.add_column(sa.Column("energy_mark_j", sa.Float(), nullable=True))
        b.add_column(sa.Column("health", sa.String(256), nullable=False, server_default=""))
    op.create_table(
        "usage_ledger",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("hour", UTCDateTime(), nullable=False),
        sa.Column("allocation_id", sa.Integer(), nullable=False),
        sa.Column("tenant", sa.String(63), nullable=False),
        sa.Column("user", sa.String(63), nullable=False),
        sa.Column("job", sa.String(63), nullable=False),
        sa.Column("service", sa.String(63), nullable=False, server_default=""),
        sa.Column("node", sa.String(63), nullable=False),
        sa.Column("model", sa.String(63), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
        sa.Column("cpu_seconds", sa.Float(), nullable=False),
        sa.Column("memory_mib_seconds", sa.Float(), nullable=False),
        sa.Column("energy_j", sa.Float(), nullable=False),
        sa.Column("idle_waste_j", sa.Float(), nullable=False),
        sa.UniqueConstraint("hour", "allocation_id", "node", "model", name="uq_usage_ledger_key"),
    )
    op.create_index("ix_usage_ledger_hour", "usage_ledger", ["hour"])
    op.create_table(
        "ledger_clock",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "device_samples",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("node", sa.String(63), nullable=False),
        sa.Column("device_index", sa.Integer(), nullable=False),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("utilization_pct", sa.Float(), nullable=True),
        sa.Column("used_memory_mib", sa.BigInteger(), nullable=True),
        sa.Column("power_w", sa.Float(), nullable=True),
    )
    op.create_index("ix_device_samples_device_at", "device_samples", ["node", "device_index", "at"])
    op.create_index("ix_device_samples_at", "device_samples", ["at"])
    op.create_table(
        "prices",
        sa.Column("item", sa.String(63), primary_key=True),
        sa.Column("amount", sa.Float(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "alert_rules",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("threshold", sa.Float(), nullable=False),
        sa.Column("duration_s", sa.Integer(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "alerts",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("rule", sa.String(64), nullable=False),
        sa.Column("subject", sa.String(256), nullable=False),
        sa.Column("tenant", sa.String(63), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("summary", sa.String(1024), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.Column("since", UTCDateTime(), nullable=False),
        sa.Column("resolved_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_alerts_rule_subject_state", "alerts", ["rule", "subject", "state"])
    op.create_index("ix_alerts_tenant", "alerts", ["tenant"])
    op.create_index("ix_alerts_state", "alerts", ["state"])
    op.create_table(
        "webhooks",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("created_by", sa.String(71), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "alert_deliveries",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("alert_id", sa.Integer(), sa.ForeignKey("alerts.id", ondelete="CASCADE"), nullable=False),
        sa.Column("event", sa.String(16), nullable=False),
        sa.Column("channel", sa.String(16), nullable=False),
        sa.Column(
            "webhook_id", sa.Integer(), sa.ForeignKey("webhooks.id", ondelete="CASCADE"), nullable=True
        ),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_at", UTCDateTime(), nullable=False),
        sa.Column("last_error", sa.String(1024), nullable=False, server_default=""),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_alert_deliveries_alert_id", "alert_deliveries", ["alert_id"])
    op.create_index("ix_alert_deliveries_webhook_id", "alert_deliveries", ["webhook_id"])
    op.create_index("ix_alert_deliveries_state", "alert_deliveries", ["state"])


def downgrade() -> None:
    for table in (
        "alert_deliveries",
        "webhooks",
        "alerts",
        "alert_rules",
        "prices",
        "device_samples",
        "ledger_clock",
        "usage_ledger",
    ):
        op.drop_table(table)
    with op.batch_alter_table("devices") as b:
        for col in ("health", "energy_mark_j", "energy_j", "power_w"):
            b.drop_column(col)
