"""Alembic environment: runs on the connection the server hands over (see `store.migrate`).

To write a new revision: `alembic -x url=sqlite:///tmp.db revision --autogenerate -m "…"` with
`script_location` pointing here, or copy the last file in `versions/` and edit it.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from computepool.store.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite alters tables by copying them
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("give the database with -x url=…")
    with create_engine(url).connect() as conn:
        _run(conn)
        conn.commit()
