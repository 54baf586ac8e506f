"""Indexes for the usage ledger: by tenant and hour (a member's usage and static equivalent read
only its tenant's rows of the window), and allocations by end time (each ledger pass books the
allocations ended since the previous one).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_usage_ledger_tenant_hour", "usage_ledger", ["tenant", "hour"])
    op.create_index("ix_allocations_ended_at", "allocations", ["ended_at"])


def downgrade() -> None:
    op.drop_index("ix_allocations_ended_at", table_name="allocations")
    op.drop_index("ix_usage_ledger_tenant_hour", table_name="usage_ledger")
