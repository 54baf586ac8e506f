"""Remote Python functions: registered functions, their worker allocations and calls, and the
Python versions each node provides.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from computepool.store.types import UTCDateTime

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("pythons", sa.JSON(), nullable=False, server_default="[]"))
    op.create_table(
        "functions",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="RESTRICT"), nullable=False
        ),
        sa.Column("owner", sa.String(63), nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("python", sa.String(16), nullable=False),
        sa.Column("keep_warm_s", sa.Integer(), nullable=False),
        sa.Column("max_workers", sa.Integer(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("last_failure", sa.String(1024), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("deleted_at", UTCDateTime(), nullable=True),
        sa.UniqueConstraint("tenant_id", "spec_hash", name="uq_functions_tenant_spec"),
    )
    op.create_index("ix_functions_tenant_id", "functions", ["tenant_id"])
    op.create_table(
        "function_workers",
        sa.Column(
            "allocation_id",
            sa.Integer(),
            sa.ForeignKey("allocations.id", ondelete="CASCADE"),
            primary_key=True,
            autoincrement=False,
        ),
        sa.Column(
            "function_id", sa.Integer(), sa.ForeignKey("functions.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("token_id", sa.String(32), nullable=False, unique=True),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("ended", sa.Boolean(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_function_workers_function_id", "function_workers", ["function_id"])
    op.create_index("ix_function_workers_ended", "function_workers", ["ended"])
    op.create_table(
        "function_calls",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "function_id", sa.Integer(), sa.ForeignKey("functions.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column(
            "tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="RESTRICT"), nullable=False
        ),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("args", sa.Text(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=True),
        sa.Column("result", sa.Text(), nullable=True),
        sa.Column("traceback", sa.Text(), nullable=True),
        sa.Column("error", sa.String(1024), nullable=True),
        sa.Column("output", sa.Text(), nullable=False),
        sa.Column("stderr", sa.Text(), nullable=False, server_default=""),
        sa.Column("worker_allocation_id", sa.Integer(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("claimed_at", UTCDateTime(), nullable=True),
        sa.Column("ended_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_function_calls_queue", "function_calls", ["function_id", "state", "id"])
    op.create_index("ix_function_calls_state", "function_calls", ["state"])
    op.create_index("ix_function_calls_worker_allocation_id", "function_calls", ["worker_allocation_id"])


def downgrade() -> None:
    op.drop_table("function_calls")
    op.drop_table("function_workers")
    op.drop_table("functions")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("pythons")
