"""The tables, as typed SQLAlchemy 2 models. Quantities use the pool's units (milli, MiB).

Migrations in `store/migrations/versions` must create exactly this schema; a test compares them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, ForeignKey, Integer, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from computepool.store.types import UTCDateTime

NAME_LEN = 63
TOKEN_ID_LEN = 32
HASH_LEN = 64


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LEN), unique=True)
    weight: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LEN), unique=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="RESTRICT"), index=True)
    role: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())

    tenant: Mapped[Tenant] = relationship(lazy="joined")


class Node(Base):
    __tablename__ = "nodes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LEN), unique=True)
    cpu_milli: Mapped[int] = mapped_column(BigInteger)
    memory_mib: Mapped[int] = mapped_column(BigInteger)
    labels: Mapped[dict[str, str]] = mapped_column(JSON)
    cordoned: Mapped[bool] = mapped_column(Boolean, default=False)
    draining: Mapped[bool] = mapped_column(Boolean, default=False)
    joined_at: Mapped[datetime] = mapped_column(UTCDateTime())
    last_heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime())

    devices: Mapped[list[Device]] = relationship(
        back_populates="node", cascade="all, delete-orphan", order_by="Device.index", lazy="selectin"
    )


class Device(Base):
    __tablename__ = "devices"
    __table_args__ = (UniqueConstraint("node_id", "index", name="uq_devices_node_index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), index=True)
    index: Mapped[int] = mapped_column(Integer)
    vendor: Mapped[str] = mapped_column(String(NAME_LEN))
    model: Mapped[str] = mapped_column(String(NAME_LEN))
    memory_mib: Mapped[int] = mapped_column(BigInteger)
    uuid: Mapped[str] = mapped_column(String(128))
    compute_milli: Mapped[int] = mapped_column(Integer)
    link_group: Mapped[str] = mapped_column(String(NAME_LEN))
    mig_parent_uuid: Mapped[str | None] = mapped_column(String(128), nullable=True)
    used_memory_mib: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    utilization_pct: Mapped[float | None] = mapped_column(Float, nullable=True)

    node: Mapped[Node] = relationship(back_populates="devices")


class ApiToken(Base):
    """A bearer credential of a user or of a node. Only the SHA-256 of the secret is kept."""

    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(TOKEN_ID_LEN), primary_key=True)
    secret_hash: Mapped[str] = mapped_column(String(HASH_LEN))
    name: Mapped[str] = mapped_column(String(NAME_LEN), default="")
    user_id: Mapped[int | None] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), index=True)
    created_by: Mapped[str] = mapped_column(String(NAME_LEN))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)

    user: Mapped[User | None] = relationship(lazy="joined")
    node: Mapped[Node | None] = relationship(lazy="joined")


class JoinToken(Base):
    """Lets a new node join once (or until it expires); hashed like API tokens."""

    __tablename__ = "join_tokens"

    id: Mapped[str] = mapped_column(String(TOKEN_ID_LEN), primary_key=True)
    secret_hash: Mapped[str] = mapped_column(String(HASH_LEN))
    single_use: Mapped[bool] = mapped_column(Boolean)
    created_by: Mapped[str] = mapped_column(String(NAME_LEN))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    uses: Mapped[int] = mapped_column(Integer, default=0)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class QuotaEntry(Base):
    """One `{guaranteed, limit}` pair of one tenant for one resource, pool-wide (`model=""`) or per model."""

    __tablename__ = "quotas"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    model: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    resource: Mapped[str] = mapped_column(String(32), primary_key=True)
    guaranteed: Mapped[int] = mapped_column(BigInteger)
    limit_value: Mapped[int] = mapped_column(BigInteger)


class AuditRecord(Base):
    """One state-changing call. `hash` = SHA-256 of the canonical JSON, which holds `prev_hash`."""

    __tablename__ = "audit_records"

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    time: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    actor: Mapped[str] = mapped_column(String(NAME_LEN + 8), index=True)
    tenant: Mapped[str | None] = mapped_column(String(NAME_LEN), nullable=True, index=True)
    action: Mapped[str] = mapped_column(String(64), index=True)
    target: Mapped[str] = mapped_column(String(256))
    outcome: Mapped[str] = mapped_column(String(64))
    request_id: Mapped[str] = mapped_column(String(64))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)
    prev_hash: Mapped[str] = mapped_column(String(HASH_LEN))
    hash: Mapped[str] = mapped_column(String(HASH_LEN))


class AuditHead(Base):
    """The single lock row of the audit chain: the last sequence number and hash."""

    __tablename__ = "audit_head"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(BigInteger)
    hash: Mapped[str] = mapped_column(String(HASH_LEN))
