"""A tenant's request defaults: what a request that names no host CPU or memory gets (booked by the
scheduler and enforced by the node's cgroup like any request), and how many processes one job may run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from computepool.wire.common import MAX_CPU_MILLI, In, Out

MAX_DEFAULT_MEMORY_MIB = 2**31 - 1  # the column's range (about 2 PiB)
MIN_PIDS = 8  # the sandbox's own shell and wrapper count too
MAX_PIDS = 4_194_304  # the kernel's largest pid_max
DefaultName = Literal["cpu_milli", "memory_mib", "pids_max", "time_limit_s", "max_time_limit_s", "max_array"]
MAX_TIME_LIMIT_S = 366 * 86400
MAX_ARRAY_CEILING = 100_000


class TenantDefaultsIn(In):
    """The fields given change; null puts one back to the pool's default; those left out stay."""

    cpu_milli: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=MAX_CPU_MILLI,
        description="Host CPU per node of a request without any.",
    )
    memory_mib: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=MAX_DEFAULT_MEMORY_MIB,
        description="Host memory per node of a request without; a job's /tmp and /dev/shm hold half each.",
    )
    pids_max: int | None = Field(
        default=None, strict=True, ge=MIN_PIDS, le=MAX_PIDS, description="Processes one job may run at once."
    )
    time_limit_s: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=MAX_TIME_LIMIT_S,
        description="A job without one gets it.",
    )
    max_time_limit_s: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=MAX_TIME_LIMIT_S,
        description="The longest a job may ask.",
    )
    max_array: int | None = Field(
        default=None, strict=True, ge=1, le=MAX_ARRAY_CEILING, description="The most jobs one array may hold."
    )


class TenantDefaultsOut(Out):
    tenant: str
    cpu_milli: int = Field(description="What a request that names no CPU gets (millicores per node).")
    memory_mib: int = Field(description="What a request that names no host memory gets (MiB per node).")
    pids_max: int = Field(description="Processes (and threads) one job of the tenant may run at once.")
    time_limit_s: int | None = Field(
        default=None, description="A job without a time limit gets this (null: none)."
    )
    max_time_limit_s: int | None = Field(default=None, description="The longest time limit (null: none).")
    max_array: int | None = Field(default=None, description="The most jobs in one array (null: none).")
    from_pool: list[DefaultName] = Field(
        description="The values that are the pool's (`cpool server --default-…`), not the tenant's own."
    )
