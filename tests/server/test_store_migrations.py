"""The migrations build exactly the schema the models describe, and running them twice is harmless."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from computepool.store import Database, upgrade
from computepool.store.db import db_now
from computepool.store.models import Base


def test_migrations_match_models(empty_db_url: str) -> None:
    db = Database(empty_db_url)
    try:
        upgrade(db)
        upgrade(db)
        with db.engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
            )
        assert diff == []
        with db.read() as s:
            assert db_now(s).tzinfo is not None
        if db.dialect == "sqlite":
            with db.engine.connect() as conn:
                assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
                assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        db.dispose()
