"""Apply the Alembic migrations shipped inside the package, at server start."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import text

from computepool.store.db import Database

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# Any constant: replicas starting together take turns instead of racing through the DDL.
_PG_MIGRATION_LOCK = 0x43504F4F4C


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def upgrade(db: Database, revision: str = "head") -> None:
    """Bring the schema to `revision`; a no-op when it is already there."""
    cfg = alembic_config()
    with db.engine.connect() as conn:
        if db.dialect == "postgresql":
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
            conn.commit()
        try:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
            conn.commit()
        finally:
            if db.dialect == "postgresql":
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_MIGRATION_LOCK})
                conn.commit()
