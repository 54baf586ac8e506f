"""Who listens on a replica's port, as its node's agent found it: "own" (the replica's job),
"other" (another process: the replica must not be marked ready through it) or "none".

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("allocations") as b:
        b.add_column(sa.Column("replica_listener", sa.String(8), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("allocations") as b:
        b.drop_column("replica_listener")
