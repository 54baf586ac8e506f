"""Gangs as one compute domain: node addresses and per-member state.

`nodes.address` is where a gang's peers reach the node; `allocations.master_port` and
`allocations.members` hold, for the current attempt of a gang over several nodes, rank 0's
rendezvous port and each member's state.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("address", sa.String(253), nullable=False, server_default=""))
    op.add_column("allocations", sa.Column("master_port", sa.Integer(), nullable=True))
    op.add_column("allocations", sa.Column("members", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("allocations") as batch:
        batch.drop_column("members")
        batch.drop_column("master_port")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("address")
