"""Logs per gang member (rank) with stdout and stderr kept apart.

Each chunk gets the rank of the node that sent it; `pos` becomes the chunk's place in its
(allocation, rank, stream) log instead of the combined one, so readers page through stdout and
stderr separately with one index.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_STREAM_POS = """
UPDATE allocation_logs SET pos = (
    SELECT COALESCE(SUM(b.size), 0) FROM allocation_logs AS b
    WHERE b.allocation_id = allocation_logs.allocation_id
      AND b.rank = allocation_logs.rank
      AND b.stream = allocation_logs.stream
      AND b.id < allocation_logs.id
)
"""

_COMBINED_POS = """
UPDATE allocation_logs SET pos = (
    SELECT COALESCE(SUM(b.size), 0) FROM allocation_logs AS b
    WHERE b.allocation_id = allocation_logs.allocation_id AND b.id < allocation_logs.id
)
"""


def upgrade() -> None:
    with op.batch_alter_table("allocation_logs") as batch:
        batch.add_column(sa.Column("rank", sa.Integer(), nullable=False, server_default="0"))
    op.execute(_STREAM_POS)
    op.drop_index("ix_allocation_logs_allocation_id", table_name="allocation_logs")
    op.create_index("ix_allocation_logs_read", "allocation_logs", ["allocation_id", "rank", "stream", "pos"])


def downgrade() -> None:
    op.drop_index("ix_allocation_logs_read", table_name="allocation_logs")
    op.create_index("ix_allocation_logs_allocation_id", "allocation_logs", ["allocation_id"])
    with op.batch_alter_table("allocation_logs") as batch:
        batch.drop_column("rank")
    op.execute(_COMBINED_POS)
