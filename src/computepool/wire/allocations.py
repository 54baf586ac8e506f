"""Allocations (requests for capacity, their slices and history) and the node agent's protocol."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictInt, StringConstraints, field_validator

from computepool.core.allocation import AllocationState, IsolationName
from computepool.core.errors import InvalidInput
from computepool.core.images import parse_image
from computepool.core.request import MAX_DEVICES_PER_NODE, MAX_GANG_NODES
from computepool.core.vendors import VENDORS, canonical
from computepool.wire.blobs import PendingFile, Sha256
from computepool.wire.common import (
    MAX_CPU_MILLI,
    MAX_ID,
    MAX_MEMORY_MIB,
    MAX_TAINTS,
    Id,
    In,
    ModelName,
    Name,
    Out,
    Toleration,
)

MAX_COMMAND_ARGS = 1024
MAX_ARG_LEN = 8192
MAX_ENV = 256
MAX_PRIORITY = 1_000_000
MAX_LOG_CHUNK = 1 << 20
EnvKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]


def _no_nul(value: str) -> str:
    """A NUL byte cannot reach exec(2): refuse it here rather than fail the job on its node."""
    if "\x00" in value:
        raise ValueError("contains a NUL byte, which no program can receive")
    return value


EnvValue = Annotated[str, StringConstraints(max_length=MAX_ARG_LEN), AfterValidator(_no_nul)]
Arg = Annotated[str, StringConstraints(max_length=MAX_ARG_LEN), AfterValidator(_no_nul)]


def _registry_image(ref: str) -> str:
    """A registry reference, spelled canonically; never a transport or a path (core.images)."""
    try:
        return parse_image(ref).canonical
    except InvalidInput as e:
        raise ValueError(e.message) from None


ImageRef = Annotated[
    str,
    StringConstraints(max_length=255),
    AfterValidator(_registry_image),
    Field(
        description="A registry image reference ([registry/]name[:tag][@digest]) an admin published to "
        "the tenant or from an allowed registry, e.g. localhost/pybase:1."
    ),
]
MigProfile = Annotated[
    str,
    StringConstraints(pattern=r"^[1-9][0-9]?g\.[1-9][0-9]{0,3}gb(\+me)?$"),
    Field(description="A MIG instance profile, e.g. 1g.10gb or 3g.40gb."),
]
LabelKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,62}$")]
LabelValue = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:/@ -]{0,63}$")]  # as node labels
Port = Annotated[int, Field(strict=True, ge=1, le=65535)]
MAX_SELECTOR = 16
# Names under CPOOL_ are the pool's: the agent and the control plane set them for a job (its
# allocation, slices, rank, a function worker's token and server). A user who could set them
# could pose as a function worker; only these, which the SDK passes to its worker, are open.
OPEN_CPOOL_ENV = frozenset({"CPOOL_SYS_PATH", "CPOOL_PIP", "CPOOL_WORKER_TRACE"})


def check_env_name(key: str) -> str:
    """`key`, unless it is one of the pool's own names (CPOOL_…, but the open ones)."""
    if key.startswith("CPOOL_") and key not in OPEN_CPOOL_ENV:
        raise ValueError(f"{key}: names starting with CPOOL_ are set by the pool, not by requests")
    return key


MAX_PORTS = 16
MAX_SECRETS = 64
SecretName = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]{0,62}$"),
    Field(description="A letter or '_', then letters, digits, '_', '.' or '-'; at most 63 characters."),
]


class SecretUse(In):
    """A secret of the tenant's (`cpool secrets set`) given to the job in its environment: the request
    holds only the names; the value reaches the node in its assignment, never shown back."""

    name: SecretName
    env: EnvKey | None = Field(
        default=None, description="The variable the job reads it from; default the name."
    )

    @field_validator("env")
    @classmethod
    def _not_the_pools(cls, env: str | None) -> str | None:
        return None if env is None else check_env_name(env)

    def variable(self) -> str:
        """The job's variable: `env`, or the name when that is a variable's name (checked at admission)."""
        return self.env or self.name


MAX_ARRAY = 1000
MAX_AFTER = 16
MAX_RETRIES = 20
AfterOn = Literal["ok", "any", "failed"]


def parse_array(spec: str) -> tuple[list[int], int | None]:
    """A job array's indices and its throttle from `0-99%8`, `0-9`, `1,3,5` or `0-20:2` (Slurm's
    --array); ValueError with a readable message otherwise."""
    body, _, limit_text = spec.strip().partition("%")
    limit: int | None = None
    if limit_text:
        if not limit_text.isdigit() or int(limit_text) < 1:
            raise ValueError(f"{spec!r}: the limit after % must be a whole number of at least 1")
        limit = int(limit_text)
    indices: list[int] = []
    for part in body.split(","):
        rng, _, step_text = part.partition(":")
        lo_text, dash, hi_text = rng.partition("-")
        texts = [lo_text, hi_text] if dash else [lo_text]
        if step_text:
            texts.append(step_text)
        if not all(t.isdigit() for t in texts) or (step_text and not dash):
            raise ValueError(f"{spec!r}: give indices as 0-99, 1,3,5 or 0-20:2, optionally with %LIMIT")
        lo = int(lo_text)
        hi = int(hi_text) if dash else lo
        step = int(step_text) if step_text else 1
        if hi < lo or step < 1:
            raise ValueError(f"{spec!r}: {part} is an empty range")
        if (hi - lo) // step + 1 + len(indices) > MAX_ARRAY:
            raise ValueError(f"{spec!r}: an array has at most {MAX_ARRAY} members")
        indices.extend(range(lo, hi + 1, step))
    if len(set(indices)) != len(indices):
        raise ValueError(f"{spec!r}: an index is given twice")
    return indices, limit


def _array_spec(spec: str) -> str:
    parse_array(spec)
    return spec


ArraySpec = Annotated[
    str,
    StringConstraints(max_length=200),
    AfterValidator(_array_spec),
    Field(
        description="A job array: one allocation per index (0-99, 1,3,5, 0-20:2), %N runs at most N at once."
    ),
]


def _known_vendor(name: str) -> str:
    if canonical(name) != name:
        raise ValueError(f"unknown vendor {name!r} (known: {', '.join(VENDORS)})")
    return name


VendorName = Annotated[
    str,
    StringConstraints(max_length=32),
    AfterValidator(_known_vendor),
    Field(description="An accelerator vendor: " + ", ".join(VENDORS) + "."),
]


StackName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,30}$")]
StackVersion = Annotated[str, StringConstraints(pattern=r"^[0-9]+(\.[0-9A-Za-z]+){0,4}$")]


class After(In):
    """Start only once allocation `id` has ended this way: ok (released, exit 0), failed (failed or
    preempted) or any end at all (cancelled too)."""

    id: Id
    on: AfterOn = "ok"


class AllocationCreate(In):
    """What to allocate. Device quantities are per node; a gang asks for `gang_nodes` such nodes."""

    name: Name | None = Field(default=None, description="A label for people; not unique.")
    tenant: Name | None = Field(default=None, description="Admins only: allocate for this tenant.")
    gpus: int = Field(default=0, strict=True, ge=0, le=MAX_DEVICES_PER_NODE, description="Devices per node.")
    gpu_milli: int = Field(
        default=1000,
        strict=True,
        ge=1,
        le=1000,
        description="Compute per device; below 1000 only with gpus=1.",
    )
    gpu_memory_mib: int | None = Field(
        default=None, strict=True, ge=0, le=2**24, description="GPU memory per device; default in proportion."
    )
    cpu_milli: int = Field(
        default=0,
        strict=True,
        ge=0,
        le=MAX_CPU_MILLI,
        description="Host CPU per node; 0 or left out: the tenant's default, booked and enforced alike.",
    )
    memory_mib: int = Field(
        default=0,
        strict=True,
        ge=0,
        le=MAX_MEMORY_MIB,
        description="Host memory per node; 0 or left out: the tenant's default, booked and enforced alike.",
    )
    models: list[ModelName] | None = Field(
        default=None, min_length=1, max_length=64, description="Allowed GPU models; default any."
    )
    vendors: list[VendorName] | None = Field(
        default=None,
        min_length=1,
        max_length=len(VENDORS),
        description="Allowed device vendors; default any.",
    )
    min_gpu_memory_mib: int | None = Field(
        default=None, strict=True, ge=1, le=2**24, description="Only devices at least this big (their size)."
    )
    stacks: dict[StackName, StackVersion] | None = Field(
        default=None,
        max_length=8,
        description='Software stacks the node must provide, at least these versions: {"cuda": "12.4"}.',
    )
    job_type: Name | None = Field(
        default=None,
        description="What kind of work this is (e.g. resnet50): the pool learns each type's speed on each "
        "device model from the progress its jobs report, and places it on the fastest model free.",
    )
    exclusive: bool = Field(default=False, strict=True, description="Whole devices, alone on them.")
    isolation: IsolationName | None = Field(
        default=None, description="Default: exclusive for whole devices, timeslice for fractions."
    )
    gang_nodes: int = Field(
        default=1, strict=True, ge=1, le=MAX_GANG_NODES, description="Nodes, bound all-or-nothing."
    )
    priority: int = Field(
        default=0,
        strict=True,
        ge=-MAX_PRIORITY,
        le=MAX_PRIORITY,
        description="Higher goes first in a tenant.",
    )
    command: list[Arg] | None = Field(
        default=None, min_length=1, max_length=MAX_COMMAND_ARGS, description="A job: run by the node agent."
    )
    env: dict[EnvKey, EnvValue] | None = Field(
        default=None, max_length=MAX_ENV, description="Job environment."
    )
    restartable: bool = Field(
        default=False, strict=True, description="Requeue (attempt + 1) after preemption or node loss."
    )
    image: ImageRef | None = Field(
        default=None, description="Run the job in this OCI container image (podman); default a process."
    )
    ports: list[Port] | None = Field(
        default=None,
        max_length=MAX_PORTS,
        description="Container ports to publish on the node; without them a container has no network.",
    )
    mig: MigProfile | None = Field(
        default=None, description="A MIG instance of this profile (implies isolation mig, one device)."
    )
    node_selector: dict[LabelKey, LabelValue] | None = Field(
        default=None, max_length=MAX_SELECTOR, description="Only nodes whose labels have all these values."
    )
    tolerations: list[Toleration] | None = Field(
        default=None,
        max_length=MAX_TAINTS,
        description="Node taints this work may go on: `key` (any value) or `key=value`.",
    )
    time_limit: StrictInt | str | None = Field(
        default=None,
        description="End the work after this long bound: seconds, or 90s, 15m, 2h, 1d.",
    )

    @field_validator("env")
    @classmethod
    def _pool_names_are_the_pools(cls, env: dict[str, str] | None) -> dict[str, str] | None:
        for key in env or {}:
            check_env_name(key)
        return env

    colocate: LabelKey | None = Field(
        default=None,
        description="A gang's nodes must all share one value of this node label (e.g. rack).",
    )
    code: Sha256 | None = Field(
        default=None, description="A tar.gz blob of the tenant's, unpacked into the job's work dir first."
    )
    stdin: Sha256 | None = Field(default=None, description="A blob of the tenant's, fed to the job's stdin.")
    secrets: list[SecretUse] | None = Field(
        default=None, max_length=MAX_SECRETS, description="Secrets of the tenant's in the job's environment."
    )
    array: ArraySpec | None = None
    after: list[After] | None = Field(
        default=None, max_length=MAX_AFTER, description="Allocations (of the same tenant) to wait for."
    )
    retries: int = Field(
        default=0,
        strict=True,
        ge=0,
        le=MAX_RETRIES,
        description="Run a job that exits non-zero again, up to this many times (back-off 1, 2, 4 … s).",
    )
    retry_on_exit: list[Annotated[int, Field(strict=True, ge=1, le=255)]] | None = Field(
        default=None,
        min_length=1,
        max_length=32,
        description="Retry only these exit codes; default any non-zero.",
    )

    @classmethod
    def unchecked(cls, **fields: Any) -> AllocationCreate:
        """As a client builds one: not checked here, since the server checks every field and answers
        422 naming it (sequences and mappings become the lists and dicts JSON has)."""
        return cls.model_construct(**{k: _plain(v) for k, v in fields.items()})

    def changed(self, **fields: Any) -> AllocationCreate:
        """A copy with some fields changed, as unchecked as `unchecked` (the server checks)."""
        return self.model_copy(update={k: _plain(v) for k, v in fields.items()})

    def body(self) -> dict[str, Any]:
        """The JSON body: only the fields that are set, so unset optionals keep the server's defaults."""
        return {k: _plain(v) for k, v in self.__dict__.items() if v is not None}


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, list | tuple):
        return list(value)
    return value


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
