"""Each control-plane replica's reachable URL (`cpool server --advertise-url`), renewed while it
runs: join and heartbeat answers name the live ones, so agents follow the replicas.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from computepool.store.types import UTCDateTime

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "control_plane_urls",
        sa.Column("url", sa.String(512), primary_key=True),
        sa.Column("seen_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("control_plane_urls")
