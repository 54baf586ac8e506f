"""Allocations (requests for capacity, their slices and history) and the node agent's protocol."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictInt, StringConstraints, field_validator

from computepool.core.allocation import IsolationName
from computepool.core.errors import InvalidInput
from computepool.core.images import parse_image
from computepool.core.request import MAX_DEVICES_PER_NODE, MAX_GANG_NODES
from computepool.core.vendors import VENDORS, canonical
from computepool.wire.blobs import Sha256
from computepool.wire.common import (
    MAX_CPU_MILLI,
    MAX_MEMORY_MIB,
    MAX_TAINTS,
    Id,
    In,
    ModelName,
    Name,
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
