"""What the API answers about allocations (requests as stored, slices, history, explain, logs) and
the node agent's protocol (assignments, reports, log chunks).

Apart from allocations.py (what a client sends) so that a client which only submits, as `cpool run`
does, builds none of these models at its start (they are half of the module's import time).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field, field_validator

from computepool.core.allocation import AllocationState, IsolationName
from computepool.wire.allocations import MAX_LOG_CHUNK, After, SecretUse
from computepool.wire.blobs import PendingFile
from computepool.wire.common import MAX_ID, Id, In, Out


class RequestOut(Out):
    name: str | None
    tenant: str
    gpus: int
    gpu_milli: int
    gpu_memory_mib: int | None
    cpu_milli: int
    memory_mib: int
    models: list[str] | None
    vendors: list[str] | None = None
    min_gpu_memory_mib: int | None = None
    stacks: dict[str, str] | None = None
    job_type: str | None = None
    exclusive: bool
    isolation: IsolationName
    gang_nodes: int
    priority: int
    command: list[str] | None
    env: dict[str, str] | None
    restartable: bool
    image: str | None = None
    image_digest: str | None = Field(default=None, description="The image the job runs: pinned at admission.")
    ports: list[int] | None = None
    mig: str | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[str] | None = None
    time_limit: int | None = Field(default=None, description="Seconds.")
    colocate: str | None = None
    code: str | None = None
    stdin: str | None = None
    secrets: list[SecretUse] | None = Field(default=None, description="Names only: values are never shown.")
    array: ArrayOut | None = None
    after: list[After] | None = None
    retries: int = 0
    retry_on_exit: list[int] | None = None
    retried: int = Field(default=0, description="Retries so far after the job's own failure.")
    retry_at: datetime | None = Field(default=None, description="A retry waits for its back-off until then.")


class ArrayOut(Out):
    """A member of a job array: the array's id is its first member's id."""

    id: int
    index: int = Field(description="This member's index (CPOOL_ARRAY_INDEX).")
    count: int = Field(description="Members of the array (CPOOL_ARRAY_COUNT).")
    limit: int | None = Field(description="At most this many members bound or running at once.")


class SliceOut(Out):
    node: str
    device_index: int
    device_uuid: str
    vendor: str = Field(
        default="", description='The device\'s vendor (core/vendors.py); "" before it was kept.'
    )
    compute_milli: int
    memory_mib: int
    isolation: IsolationName


class EventOut(Out):
    at: datetime
    state: str
    reason: str


MemberState = Literal["starting", "running", "exited", "failed", "lost", "stopped"]


class MemberOut(Out):
    """One node of a gang (an allocation over several nodes), for the current attempt."""

    rank: int = Field(description="The node's place in `nodes`; rank 0 hosts the rendezvous.")
    node: str
    address: str = Field(description="Where the other members reach this node.")
    state: MemberState
    exit_code: int | None
    reason: str


class GangOut(Out):
    """What one member of a gang is told: enough for torchrun and torch.distributed (env://)."""

    rank: int = Field(description="This node's rank (NODE_RANK).")
    size: int = Field(description="Members (NNODES).")
    master_addr: str = Field(description="Rank 0's address (MASTER_ADDR).")
    master_port: int = Field(description="A port reserved on rank 0 for this attempt (MASTER_PORT).")
    peers: list[str] = Field(description="Every member's address, in rank order (CPOOL_PEERS).")
    nproc_per_node: int = Field(description="Processes per node: its GPUs, at least 1 (NPROC_PER_NODE).")
    master_ports: list[int] | None = Field(
        default=None,
        description="FIRST, LAST: where rank 0 takes another master port when the reserved one is held on "
        "its node (then beyond them); the others are told the port rank 0 took.",
    )


class AllocationOut(Out):
    id: int
    name: str
    tenant: str
    owner: str
    request: RequestOut
    command: list[str] | None
    env: dict[str, str] | None
    restartable: bool
    state: AllocationState
    reason: str
    attempt: int
    term: int
    nodes: list[str]
    slices: list[SliceOut]
    exit_code: int | None
    created_at: datetime
    bound_at: datetime | None
    started_at: datetime | None
    ended_at: datetime | None
    events: list[EventOut] | None = Field(
        default=None, description="The state history; null in lists unless asked (`events=true`)."
    )
    members: list[MemberOut] = Field(
        default_factory=list, description="A gang's members in rank order; empty for one node."
    )
    array_id: int | None = Field(
        default=None, description="The job array it belongs to (its first member's id)."
    )
    array_index: int | None = Field(default=None, description="Its index in the job array.")
    after: list[After] | None = Field(default=None, description="What it waits for before it starts.")
    retries: int = Field(default=0, description="Retries allowed after the job's own failure.")


class ReasonsOut(Out):
    counts: dict[str, int] = Field(description="Nodes rejected, by the first filter that rejects them.")
    notes: list[str]


class ExplainOut(Out):
    state: AllocationState
    summary: str = Field(description="One line: why it is pending, or where it runs, or why it ended.")
    reasons: ReasonsOut
    quota: dict[str, Any] = Field(description="Per resource: used, request, guaranteed, limit (null: none).")
    queue_position: int | None = Field(
        description="1 = next of its tenant's pending requests; null if not pending."
    )


class Assignment(Out):
    allocation_id: int
    attempt: int
    term: int
    tenant: str
    slices: list[SliceOut]
    command: list[str]
    env: dict[str, str]
    isolation: IsolationName
    cpu_milli: int
    memory_mib: int
    pids_max: int | None = Field(
        default=None, description="Processes (and threads) the job may run at once; null: the agent's own."
    )
    restartable: bool
    image: str | None = None
    image_digest: str | None = Field(default=None, description="The image id to run, not the name.")
    ports: list[int] | None = None
    gang: GangOut | None = Field(default=None, description="Set for a member of a gang over several nodes.")
    code: str | None = Field(default=None, description="Blob to unpack into the work dir before the start.")
    stdin: str | None = Field(default=None, description="Blob to feed to the job's stdin.")
    service_port: int | None = Field(
        default=None, description="A service replica's port: the agent reports who listens on it."
    )
    private_network: bool = Field(
        default=False,
        description="A cooperative service's RPC server (made by the pool): it may make the one user "
        "and network namespace that keeps llama.cpp's unauthenticated RPC off the node's network.",
    )


class Assignments(Out):
    version: int = Field(
        description="Opaque; changes whenever this node's assignments change. Pass as since."
    )
    term: int = Field(description="The scheduler term now in force.")
    held_s: float | None = Field(
        default=None,
        description="Seconds the server held this poll before reading the assignments (its monotonic "
        "clock): the agent bounds the answer's age by its own clock, from when it sent the poll.",
    )
    assignments: list[Assignment]
    files: list[PendingFile] = Field(
        default_factory=list, description="File requests this node's agent should answer (packed job files)."
    )


class Report(In):
    allocation_id: Id
    image_digest: str | None = Field(
        default=None,
        pattern=r"^sha256:[a-f0-9]{64}$",
        description="Running, from an allowed registry: the image id the node resolved the name to.",
    )
    attempt: int = Field(strict=True, ge=1, le=MAX_ID)
    state: Literal["running", "exited", "failed", "lost"]
    exit_code: int | None = Field(default=None, strict=True, ge=-(2**31), lt=2**31)
    reason: str | None = Field(default=None, max_length=1000)
    started_at: datetime | None = None
    ended_at: datetime | None = None
    listener: Literal["own", "other", "none"] | None = Field(
        default=None,
        description="A running service replica: who listens on its port (its job, another process, nobody).",
    )
    master_port: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=65535,
        description="Rank 0 of a gang, running: the master port it offers (another than the reserved one "
        "when that was held on its node).",
    )

    @field_validator("exit_code")
    @classmethod
    def _signal_as_shell_says(cls, v: int | None) -> int | None:
        """-N (killed by signal N, as an older agent may say) is stored as the shell's 128+N."""
        return 128 - v if v is not None and -64 <= v < 0 else v


class Reports(In):
    reports: list[Report] = Field(max_length=10_000)


class StaleOut(Out):
    allocation_id: int
    attempt: int
    reason: str


class ReportsOut(Out):
    accepted: list[int] = Field(description="Allocation ids whose report was applied (or changed nothing).")
    stale: list[StaleOut] = Field(description="Attempts the control plane no longer assigns: stop them.")


class LogChunk(In):
    attempt: int = Field(strict=True, ge=1, le=MAX_ID)
    stream: Literal["stdout", "stderr"]
    offset: int = Field(
        strict=True,
        ge=0,
        le=2**62,
        description="Byte offset (UTF-8) where `data` starts in this attempt's stream.",
    )
    data: str = Field(max_length=MAX_LOG_CHUNK, description="Text without NUL (agents send U+FFFD).")

    @field_validator("data")
    @classmethod
    def _no_nul(cls, data: str) -> str:
        if "\x00" in data:
            raise ValueError("holds a NUL character, which logs do not store (send U+FFFD instead)")
        return data


class LogAppended(Out):
    next_offset: int = Field(description="The stream's length now: where the next chunk starts.")


class StreamOut(Out):
    data: str = Field(description="The stream's text from the offset asked (attempts one after another).")
    next: int = Field(description="The offset to ask for next (UTF-8 bytes).")


class LogsOut(Out):
    stdout: StreamOut
    stderr: StreamOut
    rank: int = Field(description="Whose output this is: the gang member's rank (0 for a single node).")
    ranks: int = Field(description="Members of the allocation (gang nodes); `rank` is below it.")
    attempt: int
    state: AllocationState
    exit_code: int | None
    reason: str
    ended: bool = Field(
        description="The allocation has ended and both streams were read to their end: no more output."
    )
