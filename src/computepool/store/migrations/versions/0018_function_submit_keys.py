"""A function call remembers the key of the submission it came in (`POST /functions/{id}/calls`
with `key`): a submission sent again after its answer was lost answers the same calls.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("function_calls", sa.Column("submit_key", sa.String(64), nullable=True))
    op.create_index("ix_function_calls_submit_key", "function_calls", ["function_id", "submit_key"])


def downgrade() -> None:
    op.drop_index("ix_function_calls_submit_key", table_name="function_calls")
    with op.batch_alter_table("function_calls") as batch:
        batch.drop_column("submit_key")
