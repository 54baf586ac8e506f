"""Tenants' secrets: a name and the value's ciphertext (sealed with the server's secrets key), who
set it and when; jobs name them and get the values in their environment.

Revision ID: 0020
Revises: 0018
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from computepool.store.types import UTCDateTime

revision = "0020"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "secrets",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("ciphertext", sa.Text(), nullable=False),
        sa.Column("set_by", sa.String(128), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.UniqueConstraint("tenant_id", "name", name="uq_secrets_tenant_name"),
    )


def downgrade() -> None:
    op.drop_table("secrets")
