"""The audit head's seal: an HMAC of (seq, hash) under the server's audit key.

A chain with records cut from its end, or a tail rewritten along with the head row, is again a
valid chain; the seal, made with a key the database does not hold, is what shows it.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("audit_head", sa.Column("mac", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("audit_head") as batch:
        batch.drop_column("mac")
