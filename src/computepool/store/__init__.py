"""Persistence: SQLAlchemy 2 models, one module of queries per kind of object, Alembic migrations.

Everything here takes a `Session` and returns ORM rows or plain values; no HTTP, no policy.
"""

from computepool.store.db import Database
from computepool.store.migrate import upgrade

__all__ = ["Database", "upgrade"]
