"""Remote Python functions: registration, calls, results, and the worker's two routes."""

from __future__ import annotations

import binascii
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from computepool.core.states import CallState
from computepool.wire.allocations import AllocationCreate
from computepool.wire.common import MAX_ID, Id, In, Name, Out
from computepool.wire.nodes import PythonVersion

MAX_ARGS_BYTES = 16 << 20  # one call's pickled arguments
MAX_CALLS = 1000  # calls in one submission
MAX_RESULT_BYTES = 64 << 20
MAX_OUTPUT_CHUNK = 1 << 20
MAX_WAIT_S = 60.0
MAX_CLAIM = 64  # calls a worker claims in one request
MAX_SUBMIT_WAIT_S = 5.0  # a submission waits at most this long for its calls' results
MAX_TRACEBACK = 1 << 20
OutputStream = Literal["stdout", "stderr"]
Offsets = dict[str, Annotated[int, Field(strict=True, ge=0, le=MAX_ID)]]


def _base64(limit: int) -> AfterValidator:
    def check(v: str) -> str:
        if len(v) > 4 * ((limit + 2) // 3):
            raise ValueError(f"more than {limit} bytes once decoded")
        try:
            binascii.a2b_base64(v, strict_mode=True)
        except binascii.Error as e:
            raise ValueError(f"not base64 ({e})") from None
        return v

    return AfterValidator(check)


Args = Annotated[
    str, _base64(MAX_ARGS_BYTES), Field(description="base64 of the cloudpickled (args, kwargs).")
]
Pickled = Annotated[str, _base64(MAX_RESULT_BYTES), Field(description="base64 of a cloudpickled object.")]


class FunctionCreate(In):
    """A function's workers: each is an allocation of `request` (its command starts the worker)."""

    name: Name = Field(description="Shown in listings; workers are named fn-<name>.")
    request: AllocationCreate = Field(description="One worker's request, as POST /allocations takes it.")
    python: PythonVersion = Field(default="3.11", description="The caller's Python: workers need the same.")
    keep_warm_s: int = Field(
        default=0, strict=True, ge=0, le=86400, description="Idle seconds a worker waits for the next call."
    )
    max_workers: int = Field(default=8, strict=True, ge=1, le=256, description="Workers live at once.")


class FunctionOut(Out):
    id: int
    name: str
    tenant: str
    owner: str
    python: str
    keep_warm_s: int
    max_workers: int
    workers_live: int = Field(description="Worker allocations pending, bound or active.")
    calls_pending: int = Field(description="Calls waiting for a worker.")


class CallIn(In):
    args: Args


class CallsIn(In):
    calls: list[CallIn] = Field(min_length=1, max_length=MAX_CALLS)
    key: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_-]{16,64}$",
        description="The caller's key of this submission: sent again with the same key (its answer "
        "lost to an outage), it answers the calls stored the first time instead of adding more.",
    )
    wait_s: float = Field(
        default=0.0,
        ge=0,
        le=MAX_SUBMIT_WAIT_S,
        allow_inf_nan=False,
        description="Wait up to this long for news of the calls (ended, or printed) before answering.",
    )


class ResultsIn(In):
    ids: list[Id] = Field(min_length=1, max_length=MAX_CALLS)
    wait_s: float = Field(default=0.0, ge=0, le=MAX_WAIT_S, allow_inf_nan=False)
    output_from: Offsets = Field(
        default_factory=dict,
        max_length=MAX_CALLS,
        description="Call id → characters of its stdout already read.",
    )
    stderr_from: Offsets = Field(
        default_factory=dict,
        max_length=MAX_CALLS,
        description="Call id → characters of its stderr already read.",
    )


class CallOut(Out):
    id: int
    state: CallState
    ok: bool | None = Field(description="The function returned (true) or raised (false); null: not done.")
    result: str | None = Field(description="base64 cloudpickle of the value, or of the exception.")
    traceback: str | None = Field(description="The remote traceback when it raised.")
    error: str | None = Field(description="Why the pool failed or cancelled it.")
    output: str = Field(description="What it printed on stdout, from the offset asked.")
    output_next: int
    stderr: str = Field(default="", description="What it wrote on stderr, from the offset asked.")
    stderr_next: int = 0


class ResultsOut(Out):
    calls: list[CallOut]


class CallIds(Out):
    ids: list[int] = Field(description="In the order of the calls given.")
    calls: list[CallOut] = Field(
        default_factory=list,
        description="With wait_s: the calls that ended or printed meanwhile, as POST .../results answers.",
    )


class Done(In):
    id: Id
    ok: bool = Field(strict=True)
    result: Pickled | None = None
    traceback: str | None = Field(default=None, max_length=MAX_TRACEBACK)


class NextIn(In):
    done: Done | None = None
    wait_s: float = Field(default=0.0, ge=0, le=MAX_WAIT_S, allow_inf_nan=False)


class NextCall(Out):
    id: int
    args: str


class NextOut(Out):
    call: NextCall | None
    stop: bool = Field(description="The worker should exit (function deleted, or one call per worker).")


class ClaimIn(In):
    """A worker's batch: results of calls it claimed, then up to `max_calls` more (long-poll)."""

    done: list[Done] = Field(default_factory=list, max_length=MAX_CALLS)
    max_calls: int = Field(
        default=1, strict=True, ge=0, le=MAX_CLAIM, description="Calls to claim at most (0: none)."
    )
    wait_s: float = Field(default=0.0, ge=0, le=MAX_WAIT_S, allow_inf_nan=False)
    holding: list[Id] = Field(
        default_factory=list,
        max_length=MAX_CLAIM,
        description="Calls claimed earlier and not begun yet: the answer says which to drop.",
    )


class ClaimOut(Out):
    calls: list[NextCall] = Field(description="Claimed by this worker, oldest first; run in this order.")
    drop: list[int] = Field(
        default_factory=list, description="Of `holding`, the calls no longer this worker's (cancelled)."
    )
    stop: bool = Field(description="The worker should exit (function deleted, or one call per worker).")


class OutputIn(In):
    id: Id
    data: str = Field(max_length=MAX_OUTPUT_CHUNK)
    stream: OutputStream = Field(default="stdout", description="Which of the call's streams it wrote.")


class OutputOut(Out):
    accepted: bool = Field(description="False once the call ended or its output reached the cap.")
