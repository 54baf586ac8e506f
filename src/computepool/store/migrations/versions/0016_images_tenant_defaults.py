"""Published container images (a name pinned to a digest, for all or named tenants) and each
tenant's defaults: CPU and memory for a request that names none, and a job's process limit.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from computepool.store.types import UTCDateTime

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("default_cpu_milli", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("default_memory_mib", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_pids", sa.Integer(), nullable=True))
    op.create_table(
        "images",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(256), nullable=False, unique=True),
        sa.Column("digest", sa.String(80), nullable=False),
        sa.Column("all_tenants", sa.Boolean(), nullable=False),
        sa.Column("published_by", sa.String(63), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "image_tenants",
        sa.Column("image_id", sa.Integer(), sa.ForeignKey("images.id", ondelete="CASCADE"), primary_key=True),
        sa.Column(
            "tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
        ),
    )


def downgrade() -> None:
    op.drop_table("image_tenants")
    op.drop_table("images")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("max_pids")
        batch.drop_column("default_memory_mib")
        batch.drop_column("default_cpu_milli")
