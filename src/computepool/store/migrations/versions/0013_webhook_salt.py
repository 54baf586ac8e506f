"""A random salt per webhook, mixed into its derived secret: a webhook made where a deleted one's id
is reused (SQLite reuses the highest id; a restored database does on any engine) gets a secret of
its own. Webhooks made before keep an empty salt, and so their secrets.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("webhooks") as b:
        b.add_column(sa.Column("salt", sa.String(64), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("webhooks") as b:
        b.drop_column("salt")
