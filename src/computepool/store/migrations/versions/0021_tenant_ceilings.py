"""Each tenant's time limits and array ceiling: the time limit a job that names none gets, the
longest one it may ask for, and the most jobs one array may hold (null: none).

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("default_time_limit_s", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_time_limit_s", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_array", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("max_array")
        batch.drop_column("max_time_limit_s")
        batch.drop_column("default_time_limit_s")
