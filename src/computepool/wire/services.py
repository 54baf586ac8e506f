"""Model services and the gateway: the one definition of their wire types (server, client, CLI)."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field, field_validator, model_validator

from computepool.core.states import ReplicaState
from computepool.wire.allocations import AllocationCreate, check_env_name
from computepool.wire.common import In, Name, Out
from computepool.wire.coop import CoopSpec

MAX_REPLICAS = 64


class ServiceSpec(In):
    """A model service: `request` is one replica's allocation (as POST /allocations takes it; its
    `command` starts the engine, which must listen on the port named by `port_env`)."""

    request: AllocationCreate = Field(description="One replica's request; it must have a command.")
    port_env: str = Field(
        default="PORT", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$",
        description="The variable that gives each replica the port to listen on.",
    )  # fmt: skip
    min_replicas: int = Field(default=1, strict=True, ge=0, le=MAX_REPLICAS)
    max_replicas: int = Field(default=1, strict=True, ge=1, le=MAX_REPLICAS)
    target_inflight: int = Field(
        default=4, strict=True, ge=1, le=10_000,
        description="Requests in flight (and queued) per replica the autoscaler aims at.",
    )  # fmt: skip
    max_inflight: int | None = Field(
        default=None, strict=True, ge=1, le=10_000,
        description="Requests one replica is sent at once (default: 2 × target_inflight); "
        "beyond, the gateway queues.",
    )  # fmt: skip
    health_path: str = Field(default="/health", pattern=r"^/[!-~]{0,255}$")
    startup_grace_s: int = Field(default=300, strict=True, ge=1, le=86_400)
    idle_s: int = Field(
        default=600, strict=True, ge=1, le=30 * 86_400,
        description="With min_replicas 0: no request for this long scales the service to zero.",
    )  # fmt: skip
    scale_down_delay_s: int = Field(
        default=60, strict=True, ge=0, le=86_400,
        description="Load must stay below the current replicas' for this long before one is removed.",
    )  # fmt: skip
    drain_s: int = Field(
        default=60, strict=True, ge=0, le=86_400,
        description="A replica being removed gets no new requests and at most this long to finish.",
    )  # fmt: skip
    cooperative: CoopSpec | None = Field(
        default=None,
        description="Split one GGUF model over devices of several nodes (llama.cpp RPC); the coop "
        "controller writes `request.command` and places the replica.",
    )
    queue_timeout_s: int = Field(
        default=120, strict=True, ge=1, le=3600,
        description="A request waiting longer for a replica is answered 503.",
    )  # fmt: skip

    @field_validator("port_env")
    @classmethod
    def _port_env_is_not_the_pools(cls, name: str) -> str:
        return check_env_name(name)

    @model_validator(mode="after")
    def _check(self) -> ServiceSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} is above max_replicas {self.max_replicas}")
        if self.cooperative is not None:
            if self.max_replicas != 1 or self.min_replicas > 1:
                raise ValueError("a cooperative service runs one replica (min_replicas ≤ 1, max_replicas 1)")
        elif not self.request.command:
            raise ValueError("request.command: a service's replicas need a command (the engine)")
        if self.request.gang_nodes != 1:
            raise ValueError("request.gang_nodes: a replica runs on one node")
        return self

    @property
    def per_replica_limit(self) -> int:
        return self.max_inflight or 2 * self.target_inflight


class ServiceIn(In):
    """PUT /services/{name}: create the service, or change it (a new generation when it differs)."""

    spec: ServiceSpec
    tenant: Name | None = Field(default=None, description="Admins only: the service's tenant.")


class ReplicaOut(Out):
    allocation_id: int
    state: str = Field(description="The allocation's state: pending, bound, active, ….")
    replica_state: ReplicaState | None = Field(description="What the service controller found.")
    generation: int
    node: str | None
    endpoint: str | None = Field(description="http://ADDRESS:PORT once bound.")
    inflight: int = Field(description="Requests in flight on it, over all gateways.")
    since: datetime | None
    reason: str


class ServiceOut(Out):
    id: int
    name: str
    tenant: str
    owner: str
    generation: int
    desired: int
    ready: int
    inflight: int
    queued: int
    reason: str = Field(description="Why the controller chose `desired` replicas (or what is wrong).")
    spec: ServiceSpec
    replicas: list[ReplicaOut]
    created_at: datetime
    updated_at: datetime
    last_request_at: datetime | None


class GatewayLimitIn(In):
    requests_per_minute: int = Field(strict=True, ge=1, le=10_000_000)
    burst: int | None = Field(
        default=None, strict=True, ge=1, le=10_000_000, description="Default: rpm/6, at least 1."
    )


class GatewayLimitOut(Out):
    tenant: str
    requests_per_minute: int
    burst: int


class UsageRow(Out):
    tenant: str
    user: str
    token_id: str
    service: str
    hour: datetime
    requests: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
