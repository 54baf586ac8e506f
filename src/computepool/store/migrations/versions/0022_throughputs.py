"""Measured speeds: per tenant, job type, device model and device count, an exponentially weighted
mean of the steps/s its jobs reported, the number of reports and the last one's time.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from computepool.store.types import UTCDateTime

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "throughputs",
        sa.Column(
            "tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("job_type", sa.String(63), primary_key=True),
        sa.Column("model", sa.String(63), primary_key=True),
        sa.Column("devices", sa.Integer(), primary_key=True),
        sa.Column("steps_per_s", sa.Float(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("throughputs")
