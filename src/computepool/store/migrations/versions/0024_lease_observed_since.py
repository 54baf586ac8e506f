"""The scheduling lease says since when its holder has watched the nodes with a working database,
so every replica judges a node's silence as the leader does (`cpool nodes`, /metrics).

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from computepool.store.types import UTCDateTime

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("scheduler_lease") as batch:
        batch.add_column(sa.Column("observed_since", UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("scheduler_lease") as batch:
        batch.drop_column("observed_since")
