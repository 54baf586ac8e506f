"""The tables, as typed SQLAlchemy 2 models. Quantities use the pool's units (milli, MiB).

Migrations in `store/migrations/versions` must create exactly this schema; a test compares them.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    UniqueConstraint,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from computepool.core.allocation import AllocationState
from computepool.core.states import AlertState, CallState, DeliveryState, FileState, ReplicaState
from computepool.store.types import UTCDateTime

NAME_LEN = 63
TOKEN_ID_LEN = 32
HASH_LEN = 64


class Base(DeclarativeBase):
    if TYPE_CHECKING:  # every model maps one Table (SQLAlchemy types it as any FromClause)
        __table__: ClassVar[Table]


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LEN), unique=True)
    weight: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # What a request that names no CPU or memory gets (None: the pool's default), and the most
    # processes one job of the tenant may run (None: the pool's default).
    default_cpu_milli: Mapped[int | None] = mapped_column(Integer, nullable=True)
    default_memory_mib: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_pids: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Ceilings (None: none): the time limit of a job that names none, the longest one it may ask
    # for, and the most jobs one array may hold.
    default_time_limit_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_time_limit_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_array: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Image(Base):
    """A container image an admin published: its name, pinned to one digest, for all or some tenants."""

    __tablename__ = "images"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(256), unique=True)
    digest: Mapped[str] = mapped_column(String(80))
    all_tenants: Mapped[bool] = mapped_column(Boolean)
    published_by: Mapped[str] = mapped_column(String(NAME_LEN))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ImageTenant(Base):
    """One tenant an image was published to (when it is not published to all)."""

    __tablename__ = "image_tenants"

    image_id: Mapped[int] = mapped_column(ForeignKey("images.id", ondelete="CASCADE"), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)


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
    # key -> value; work that does not tolerate every taint stays off the node
    taints: Mapped[dict[str, str]] = mapped_column(JSON, default=dict, server_default="{}")
    # the tenant the node is set aside for; others borrow it as preemptible work, or never
    dedicated_tenant_id: Mapped[int | None] = mapped_column(ForeignKey("tenants.id"), nullable=True)
    lending: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    # where a gang's peers reach this node (MASTER_ADDR of a gang whose rank 0 it is)
    address: Mapped[str] = mapped_column(String(253), default="", server_default="")
    # Python versions ("3.11") a tenant's job can run on this node, as its agent reported them
    pythons: Mapped[list[str]] = mapped_column(JSON, default=list, server_default="[]")
    joined_at: Mapped[datetime] = mapped_column(UTCDateTime())
    last_heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime())

    devices: Mapped[list[Device]] = relationship(
        back_populates="node", cascade="all, delete-orphan", order_by="Device.index", lazy="selectin"
    )
    dedicated_tenant: Mapped[Tenant | None] = relationship(lazy="joined")


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
    # power draw (W) and the vendor's total-energy counter (J, NVML's since driver load) as the
    # last heartbeat reported them; `energy_mark_j` is the counter where the ledger last booked
    power_w: Mapped[float | None] = mapped_column(Float, nullable=True)
    energy_j: Mapped[float | None] = mapped_column(Float, nullable=True)
    energy_mark_j: Mapped[float | None] = mapped_column(Float, nullable=True)
    # "" while healthy, else why not (NVML errors, XID events), as the last heartbeat said
    health: Mapped[str] = mapped_column(String(256), default="", server_default="")

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


class ReclaimPolicy(Base):
    """A tenant's idle reclaim: allocations whose devices show no use for `idle_s` are released,
    with a warning `warn_s` before. No row: the tenant's allocations are never reclaimed."""

    __tablename__ = "reclaim_policies"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    idle_s: Mapped[int] = mapped_column(Integer)
    warn_s: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


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
    """The single lock row of the audit chain: the last sequence number and hash, and their seal
    (HMAC under the server's audit key; NULL until a server with a key first writes it)."""

    __tablename__ = "audit_head"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(BigInteger)
    hash: Mapped[str] = mapped_column(String(HASH_LEN))
    mac: Mapped[str | None] = mapped_column(String(HASH_LEN), nullable=True)


class Allocation(Base):
    """A request for capacity and, once bound, its slices. `request` holds the validated API request.

    `attempt` grows with every requeue; `term` is the scheduler term that bound the current attempt.
    """

    __tablename__ = "allocations"
    __table_args__ = (UniqueConstraint("owner", "idempotency_key", name="uq_allocations_owner_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LEN))
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="RESTRICT"), index=True)
    owner: Mapped[str] = mapped_column(String(NAME_LEN))
    idempotency_key: Mapped[str | None] = mapped_column(String(128), nullable=True)
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    priority: Mapped[int] = mapped_column(Integer)
    command: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    env: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    restartable: Mapped[bool] = mapped_column(Boolean)
    state: Mapped[AllocationState] = mapped_column(String(16), index=True)
    reason: Mapped[str] = mapped_column(String(1024))
    attempt: Mapped[int] = mapped_column(Integer)
    term: Mapped[int] = mapped_column(BigInteger)
    nodes: Mapped[list[str]] = mapped_column(JSON)
    slices: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # a gang over several nodes, per attempt: rank 0's rendezvous port and each member's state
    master_port: Mapped[int | None] = mapped_column(Integer, nullable=True)
    members: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    bound_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True, index=True)
    # a replica of a model service: the service, the spec generation it runs, the port it listens
    # on (its env's port variable), and what the service controller last found of it
    service_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    service_generation: Mapped[int | None] = mapped_column(Integer, nullable=True)
    service_port: Mapped[int | None] = mapped_column(Integer, nullable=True)
    replica_state: Mapped[ReplicaState | None] = mapped_column(String(16), nullable=True)
    replica_since: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # who listens on service_port, as the node's agent found it: "own", "other" or "none"
    replica_listener: Mapped[str | None] = mapped_column(String(8), nullable=True)
    # part of a cooperative service that is not its replica: a llama.cpp RPC server ("rpc") or a
    # speed probe ("probe") the coop controller started (server/coop/)
    coop_service_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    coop_role: Mapped[str | None] = mapped_column(String(16), nullable=True)

    tenant: Mapped[Tenant] = relationship(lazy="joined")


class AllocationEvent(Base):
    """One state transition of an allocation, with its reason: the allocation's history."""

    __tablename__ = "allocation_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime())
    state: Mapped[AllocationState] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(String(1024))
    attempt: Mapped[int] = mapped_column(Integer)
    term: Mapped[int] = mapped_column(BigInteger)


class AllocationNode(Base):
    """Which nodes hold a bound or active allocation (rows live only while it holds them)."""

    __tablename__ = "allocation_nodes"

    allocation_id: Mapped[int] = mapped_column(
        ForeignKey("allocations.id", ondelete="CASCADE"), primary_key=True
    )
    node: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True, index=True)


class AllocationLog(Base):
    """A chunk of a job's output. Offsets and `size` count UTF-8 bytes, as the agent reads its files;
    `stream_offset` is the chunk's place in its attempt's stream as the agent wrote it, `pos` its place
    in the (allocation, rank, stream) log readers page through, attempts one after the other."""

    __tablename__ = "allocation_logs"
    __table_args__ = (Index("ix_allocation_logs_read", "allocation_id", "rank", "stream", "pos"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer, server_default="0")
    stream: Mapped[str] = mapped_column(String(8))
    stream_offset: Mapped[int] = mapped_column(BigInteger)
    pos: Mapped[int] = mapped_column(BigInteger)
    size: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[str] = mapped_column(Text)


class SchedulerLease(Base):
    """The single row saying which replica schedules, and in which term (fencing)."""

    __tablename__ = "scheduler_lease"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    holder: Mapped[str] = mapped_column(String(64))
    term: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # since when the holder has watched the nodes with a working database: node silence counts
    # from no earlier, on every replica (None: never said, e.g. before this column existed)
    observed_since: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class ControlPlaneUrl(Base):
    """A control-plane replica's reachable URL, as it last published it: agents learn the
    replicas from these (rows not renewed for a while belong to replicas that are gone)."""

    __tablename__ = "control_plane_urls"

    url: Mapped[str] = mapped_column(String(512), primary_key=True)
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Blob(Base):
    """A content-addressed blob a tenant holds (code archive, stdin, fetched files); the bytes are a
    file under the server's data dir, shared by every tenant that holds them, counted for each."""

    __tablename__ = "blobs"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    sha256: Mapped[str] = mapped_column(String(HASH_LEN), primary_key=True, index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    last_used_at: Mapped[datetime] = mapped_column(UTCDateTime())


class FileRequest(Base):
    """A user's ask for files a job wrote: the node's agent packs `path` from the job's work dir (as
    the tenant's user) into a blob of the tenant, or says why it could not."""

    __tablename__ = "file_requests"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id", ondelete="CASCADE"), index=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    node: Mapped[str] = mapped_column(String(NAME_LEN), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(1024))
    state: Mapped[FileState] = mapped_column(String(16), index=True)
    blob_sha256: Mapped[str | None] = mapped_column(String(HASH_LEN), nullable=True)
    size: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    error: Mapped[str] = mapped_column(String(1024), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Function(Base):
    """A registered remote Python function of a tenant: the per-worker request and how workers run.

    `spec_hash` makes registration idempotent per tenant; `failures` counts consecutive workers
    that ended failed before claiming a call (see services/function_workers.py)."""

    __tablename__ = "functions"
    __table_args__ = (UniqueConstraint("tenant_id", "spec_hash", name="uq_functions_tenant_spec"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="RESTRICT"), index=True)
    owner: Mapped[str] = mapped_column(String(NAME_LEN))
    name: Mapped[str] = mapped_column(String(NAME_LEN))
    spec_hash: Mapped[str] = mapped_column(String(HASH_LEN))
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    python: Mapped[str] = mapped_column(String(16))
    keep_warm_s: Mapped[int] = mapped_column(Integer)
    max_workers: Mapped[int] = mapped_column(Integer)
    failures: Mapped[int] = mapped_column(Integer, default=0)
    last_failure: Mapped[str] = mapped_column(String(1024), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class FunctionWorker(Base):
    """A worker allocation of a function and its bearer token (only the SHA-256 of the secret).

    `ended` flips once the control plane has seen its allocation end and settled its calls."""

    __tablename__ = "function_workers"

    allocation_id: Mapped[int] = mapped_column(
        ForeignKey("allocations.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    function_id: Mapped[int] = mapped_column(ForeignKey("functions.id", ondelete="CASCADE"), index=True)
    token_id: Mapped[str] = mapped_column(String(TOKEN_ID_LEN), unique=True)
    secret_hash: Mapped[str] = mapped_column(String(HASH_LEN))
    ended: Mapped[bool] = mapped_column(Boolean, default=False, index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class FunctionCall(Base):
    """One call of a function: its pickled arguments and, once ended, its result or error.

    `args` and `result` hold base64 text as the API carries it; `output` is what the call printed
    on stdout, `stderr` what it wrote on stderr (kept apart, as the caller's terminal keeps them)."""

    __tablename__ = "function_calls"
    __table_args__ = (
        Index("ix_function_calls_queue", "function_id", "state", "id"),
        Index("ix_function_calls_submit_key", "function_id", "submit_key"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    function_id: Mapped[int] = mapped_column(ForeignKey("functions.id", ondelete="CASCADE"))
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="RESTRICT"))
    state: Mapped[CallState] = mapped_column(String(16), index=True)
    args: Mapped[str] = mapped_column(Text)
    ok: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    result: Mapped[str | None] = mapped_column(Text, nullable=True)
    traceback: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    output: Mapped[str] = mapped_column(Text, default="")
    stderr: Mapped[str] = mapped_column(Text, default="", server_default="")
    worker_allocation_id: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    claimed_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # the caller's key of the submission it came in: the same submission sent again (its answer
    # was lost to an outage) answers these calls rather than adding more
    submit_key: Mapped[str | None] = mapped_column(String(64), nullable=True)


class Service(Base):
    """A model service of a tenant: `spec` holds the validated ServiceSpec (schemas/services.py);
    `generation` grows with every change of it (replicas of older generations are replaced one by
    one); `desired` is the replica count the service controller last chose, and `reason` why."""

    __tablename__ = "services"
    __table_args__ = (Index("ix_services_tenant_name", "tenant_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="RESTRICT"))
    owner: Mapped[str] = mapped_column(String(NAME_LEN))
    name: Mapped[str] = mapped_column(String(NAME_LEN))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    generation: Mapped[int] = mapped_column(Integer)
    desired: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String(1024), default="", server_default="")
    last_request_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class GatewayLoad(Base):
    """One gateway process's load on one service, rewritten about twice a second: requests in
    flight and queued, and per replica allocation id (as a string) its requests in flight."""

    __tablename__ = "gateway_load"

    gateway: Mapped[str] = mapped_column(String(128), primary_key=True)
    service_id: Mapped[int] = mapped_column(ForeignKey("services.id", ondelete="CASCADE"), primary_key=True)
    inflight: Mapped[int] = mapped_column(Integer)
    queued: Mapped[int] = mapped_column(Integer)
    replicas: Mapped[dict[str, int]] = mapped_column(JSON)
    requests: Mapped[int] = mapped_column(BigInteger)  # answered since the gateway started
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class GatewayUsage(Base):
    """Gateway use per tenant, user, token, service and hour (UTC, truncated): requests, failed
    ones, and the prompt and completion tokens the engine's answers reported."""

    __tablename__ = "gateway_usage"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    user: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    token_id: Mapped[str] = mapped_column(String(TOKEN_ID_LEN), primary_key=True)
    service: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    hour: Mapped[datetime] = mapped_column(UTCDateTime(), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    failed: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)


class GatewayLimit(Base):
    """A tenant's gateway rate limit: requests per minute, with bursts up to `burst`."""

    __tablename__ = "gateway_limits"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    requests_per_minute: Mapped[int] = mapped_column(Integer)
    burst: Mapped[int] = mapped_column(Integer)


class UsageEntry(Base):
    """The usage ledger: what one allocation used on one node and device model in one UTC hour.

    `allocation_id` 0 is the pool's own row: the energy of devices that held nothing. `gpu_seconds`
    is device share × seconds (a half slice for an hour: 1800); `model` is "" for the host share
    (CPU and memory) of an allocation. `idle_waste_j` is energy of devices held but not used."""

    __tablename__ = "usage_ledger"
    __table_args__ = (
        UniqueConstraint("hour", "allocation_id", "node", "model", name="uq_usage_ledger_key"),
        Index("ix_usage_ledger_hour", "hour"),
        Index("ix_usage_ledger_tenant_hour", "tenant", "hour"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    hour: Mapped[datetime] = mapped_column(UTCDateTime())
    allocation_id: Mapped[int] = mapped_column(Integer)
    tenant: Mapped[str] = mapped_column(String(NAME_LEN))
    user: Mapped[str] = mapped_column(String(NAME_LEN))
    job: Mapped[str] = mapped_column(String(NAME_LEN))
    service: Mapped[str] = mapped_column(String(NAME_LEN), default="", server_default="")
    node: Mapped[str] = mapped_column(String(NAME_LEN))
    model: Mapped[str] = mapped_column(String(NAME_LEN))
    gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    cpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    memory_mib_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    energy_j: Mapped[float] = mapped_column(Float, default=0.0)
    idle_waste_j: Mapped[float] = mapped_column(Float, default=0.0)


class LedgerClock(Base):
    """The single row saying up to when the ledger has booked (so a new leader books no second time)."""

    __tablename__ = "ledger_clock"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    at: Mapped[datetime] = mapped_column(UTCDateTime())


class DeviceSample(Base):
    """A device's utilization, memory and power at one moment: its history (kept a while)."""

    __tablename__ = "device_samples"
    __table_args__ = (Index("ix_device_samples_device_at", "node", "device_index", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[str] = mapped_column(String(NAME_LEN))
    device_index: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    utilization_pct: Mapped[float | None] = mapped_column(Float, nullable=True)
    used_memory_mib: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    power_w: Mapped[float | None] = mapped_column(Float, nullable=True)


class Price(Base):
    """One price: per GPU-hour of a device model (`item` the model), or per kWh (`item` "energy-kwh")."""

    __tablename__ = "prices"

    item: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    amount: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class AlertRule(Base):
    """An operator's setting of one built-in alert rule (no row: the rule's defaults)."""

    __tablename__ = "alert_rules"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    enabled: Mapped[bool] = mapped_column(Boolean)
    threshold: Mapped[float] = mapped_column(Float)
    duration_s: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Alert(Base):
    """One alert of one rule about one subject (a node, a device, an allocation, a tenant…): firing
    from `since`, resolved at `resolved_at`. `tenant` is set where the subject belongs to one."""

    __tablename__ = "alerts"
    __table_args__ = (Index("ix_alerts_rule_subject_state", "rule", "subject", "state"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    rule: Mapped[str] = mapped_column(String(64))
    subject: Mapped[str] = mapped_column(String(256))
    tenant: Mapped[str | None] = mapped_column(String(NAME_LEN), nullable=True, index=True)
    state: Mapped[AlertState] = mapped_column(String(16), index=True)
    severity: Mapped[str] = mapped_column(String(16))  # warning | critical
    summary: Mapped[str] = mapped_column(String(1024))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)
    since: Mapped[datetime] = mapped_column(UTCDateTime())
    resolved_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Webhook(Base):
    """Where alert notifications are POSTed. The signing secret is not stored: it is derived from the
    server's webhook key, the id and a random `salt` (an id can be reused after a delete), and shown
    once when the webhook is made."""

    __tablename__ = "webhooks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    url: Mapped[str] = mapped_column(String(2048))
    created_by: Mapped[str] = mapped_column(String(NAME_LEN + 8))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    salt: Mapped[str] = mapped_column(String(64), default="", server_default="")


class AlertDelivery(Base):
    """The notification outbox: one firing or resolved event of an alert to one channel (a webhook,
    or mail), retried with back-off until sent or given up."""

    __tablename__ = "alert_deliveries"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    alert_id: Mapped[int] = mapped_column(ForeignKey("alerts.id", ondelete="CASCADE"), index=True)
    event: Mapped[str] = mapped_column(String(16))  # firing | resolved
    channel: Mapped[str] = mapped_column(String(16))  # webhook | mail
    webhook_id: Mapped[int | None] = mapped_column(
        ForeignKey("webhooks.id", ondelete="CASCADE"), nullable=True, index=True
    )
    state: Mapped[DeliveryState] = mapped_column(String(16), index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_at: Mapped[datetime] = mapped_column(UTCDateTime())
    last_error: Mapped[str] = mapped_column(String(1024), default="", server_default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class NodePeer(Base):
    """One peer a node's discovery found on its LAN, as that node (the `observer`) last reported it:
    verified (`status` "ok", with the link measured from the observer) or rejected with the reason.
    `peer_key` is the announced node id, or "address:port" for what could not be parsed."""

    __tablename__ = "node_peers"
    __table_args__ = (UniqueConstraint("observer", "peer_key", name="uq_node_peers_observer_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    observer: Mapped[str] = mapped_column(String(NAME_LEN))
    peer_key: Mapped[str] = mapped_column(String(160))
    node_id: Mapped[str | None] = mapped_column(String(NAME_LEN), nullable=True)
    instance: Mapped[str] = mapped_column(String(64), default="", server_default="")
    address: Mapped[str] = mapped_column(String(253), default="", server_default="")
    port: Mapped[int | None] = mapped_column(Integer, nullable=True)
    devices: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))  # ok | rejected
    reason: Mapped[str] = mapped_column(String(512), default="", server_default="")
    source: Mapped[str] = mapped_column(String(16), default="", server_default="")  # mdns | unicast
    rtt_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    bandwidth_mbps: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime())
    reported_at: Mapped[datetime] = mapped_column(UTCDateTime())


class CoopMeasurement(Base):
    """A model's measured decoding speed on one device of one node (a probe allocation ran it), and
    the memory that device offered: the planner's inputs, kept per model (`model_key`)."""

    __tablename__ = "coop_measurements"
    __table_args__ = (UniqueConstraint("model_key", "node", "device", name="uq_coop_measurements_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_key: Mapped[str] = mapped_column(String(128))
    node: Mapped[str] = mapped_column(String(NAME_LEN))
    device: Mapped[str] = mapped_column(String(32))  # "cpu" or "gpu<index>"
    tokens_per_s: Mapped[float] = mapped_column(Float)
    memory_mib: Mapped[int] = mapped_column(Integer)
    measured_at: Mapped[datetime] = mapped_column(UTCDateTime())
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)


class CoopPlan(Base):
    """A cooperative service's current plan: which devices hold which layers and why (the planner's
    output, JSON as `CoopPlanOut`), and where the coop controller is with it."""

    __tablename__ = "coop_plans"

    service_id: Mapped[int] = mapped_column(ForeignKey("services.id", ondelete="CASCADE"), primary_key=True)
    status: Mapped[str] = mapped_column(String(16))  # CoopStatus
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    reason: Mapped[str] = mapped_column(Text, default="", server_default="")
    attempt: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Secret(Base):
    """A tenant's named secret (an API token, a password): only its ciphertext, sealed with the
    server's secrets key and bound to its tenant and name (server/secret_box.py); the value reaches
    nothing but the environment of the tenant's jobs that name it."""

    __tablename__ = "secrets"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_secrets_tenant_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(NAME_LEN))
    ciphertext: Mapped[str] = mapped_column(Text)
    set_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Throughput(Base):
    """A tenant's measured speed of one job type on `devices` devices of one model: an exponentially
    weighted mean of the steps/s its jobs reported (server/logic/throughputs.py), how many reports
    went into it and when the last came. Keyed by tenant: job type names are the tenant's own."""

    __tablename__ = "throughputs"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    job_type: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    model: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    devices: Mapped[int] = mapped_column(Integer, primary_key=True)
    steps_per_s: Mapped[float] = mapped_column(Float)
    samples: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class RelaySession(Base):
    """A user's shell (`cpool exec`) or tunnelled connection (`cpool forward`) into a running job:
    the replica at `replica` holds the user's socket until the node's agent dials back with
    `node_secret` (handed out once, wiped when used); the server only relays bytes between them."""

    __tablename__ = "relay_sessions"
    __table_args__ = {"sqlite_autoincrement": True}  # ids never reused: agents ask for those past one

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id", ondelete="CASCADE"), index=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    node: Mapped[str] = mapped_column(String(NAME_LEN), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))  # exec | forward
    command: Mapped[list[str]] = mapped_column(JSON)
    tty: Mapped[bool] = mapped_column(Boolean)
    rows: Mapped[int] = mapped_column(Integer)
    cols: Mapped[int] = mapped_column(Integer)
    port: Mapped[int] = mapped_column(Integer)
    created_by: Mapped[str] = mapped_column(String(128))  # the token id that asked
    client_secret_hash: Mapped[str] = mapped_column(String(HASH_LEN))
    node_secret: Mapped[str] = mapped_column(String(HASH_LEN))  # "" once used or ended
    replica: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    state: Mapped[str] = mapped_column(String(16), index=True)  # pending | open | closed
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
