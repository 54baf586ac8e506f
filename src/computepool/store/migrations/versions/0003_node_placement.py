"""Static placement on nodes: taints that keep general work off, and dedication to one tenant.

Labels already live on `nodes.labels`; this adds the other two node-level constraints the
scheduler checks before looking at devices.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN on SQLite too (no table copy): copying `nodes` with foreign keys on would
    # cascade-delete its devices and tokens.
    op.add_column("nodes", sa.Column("taints", sa.JSON(), nullable=False, server_default="{}"))
    if op.get_bind().dialect.name == "sqlite":
        # SQLite takes a REFERENCES clause in ADD COLUMN, but not a separate ADD CONSTRAINT
        op.execute("ALTER TABLE nodes ADD COLUMN dedicated_tenant_id INTEGER REFERENCES tenants (id)")
    else:
        op.add_column("nodes", sa.Column("dedicated_tenant_id", sa.Integer(), nullable=True))
        op.create_foreign_key(
            "fk_nodes_dedicated_tenant_id",
            "nodes",
            "tenants",
            ["dedicated_tenant_id"],
            ["id"],
        )
    op.add_column("nodes", sa.Column("lending", sa.Boolean(), nullable=False, server_default=sa.true()))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("lending")
        batch.drop_column("dedicated_tenant_id")
        batch.drop_column("taints")
