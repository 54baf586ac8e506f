"""Allocations: create (idempotent with `Idempotency-Key`), list, get, explain, release, cancel, logs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from computepool.core.allocation import AllocationState
from computepool.server import topics
from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.hub import Hub
from computepool.server.logic import allocations
from computepool.server.policy import Action
from computepool.server.routers.answer import answer
from computepool.server.routers.polling import long_poll
from computepool.wire.allocation_out import AllocationOut, ExplainOut, LogsOut
from computepool.wire.allocations import AllocationCreate
from computepool.wire.common import MAX_ID, Items

router = APIRouter(tags=["allocations"])
MAX_WAIT_S = 30.0
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        max_length=128,
        pattern=r"^[A-Za-z0-9._:-]{1,128}$",
        description="Retries with the same key return the allocation the first call made.",
    ),
]


async def get_hub(request: Request) -> Hub:
    """On the event loop: FastAPI runs a plain `def` dependency in a worker thread, a hop per request."""
    hub: Hub = request.app.state.hub
    return hub


@router.post(
    "/allocations",
    status_code=201,
    response_model=AllocationOut,
    summary="Ask the pool for capacity (201 created; 200 when the Idempotency-Key was seen)",
    responses={200: {"description": "The allocation an earlier call with this key created"}},
)
def create(
    body: AllocationCreate,
    response: Response,
    ctx: Annotated[Ctx, Depends(requires(Action.ALLOCATION_CREATE))],
    hub: Annotated[Hub, Depends(get_hub)],
    idempotency_key: IdempotencyKey = None,
) -> Response:
    out, created = allocations.create(ctx, body, idempotency_key, hub)
    response.status_code = 201 if created else 200
    return answer(out, response)


@router.get("/allocations", summary="Allocations, newest first")
def list_allocations(
    ctx: Annotated[Ctx, Depends(requires(Action.ALLOCATION_LIST))],
    state: Annotated[AllocationState | None, Query(description="Only this state.")] = None,
    tenant: Annotated[str | None, Query(max_length=63, description="Only this tenant (admins).")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000, description="At most this many.")] = 100,
    events: Annotated[
        bool, Query(description="Include each allocation's history (else `events` is null).")
    ] = False,
    array: Annotated[
        int | None, Query(ge=1, le=MAX_ID, description="Only the members of this job array (its id).")
    ] = None,
) -> Items[AllocationOut]:
    return allocations.list_all(ctx, state=state, tenant=tenant, limit=limit, events=events, array=array)


@router.get(
    "/allocations/{alloc_id}",
    summary="One allocation with its slices and history (long-poll for a state change with wait)",
)
async def get_allocation(
    alloc_id: int,
    ctx: Annotated[Ctx, Depends(requires(Action.ALLOCATION_GET))],
    hub: Annotated[Hub, Depends(get_hub)],
    wait: Annotated[
        float, Query(ge=0, le=MAX_WAIT_S, description="Seconds to wait while the state is `state`.")
    ] = 0,
    state: Annotated[
        AllocationState | None,
        Query(description="With wait: answer once the state differs from this (default: the current one)."),
    ] = None,
) -> AllocationOut:
    first = await run_in_threadpool(allocations.get, ctx, alloc_id)
    waited = first.state if state is None else state
    if first.state != waited or wait <= 0:
        return first
    return await long_poll(
        hub,
        topics.alloc(alloc_id),
        wait,
        lambda: allocations.get(ctx, alloc_id),
        lambda out: out.state != waited,
    )


@router.get("/allocations/{alloc_id}/explain", summary="Why it is pending, where it runs, or why it ended")
def explain(alloc_id: int, ctx: Annotated[Ctx, Depends(requires(Action.ALLOCATION_GET))]) -> ExplainOut:
    return allocations.explain(ctx, alloc_id)


@router.post("/allocations/{alloc_id}/release", summary="Give a bound or active allocation back")
def release(
    alloc_id: int,
    ctx: Annotated[Ctx, Depends(requires(Action.ALLOCATION_RELEASE))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> AllocationOut:
    return allocations.release(ctx, alloc_id, hub)


@router.post("/allocations/{alloc_id}/cancel", summary="Cancel a pending, bound or active allocation")
def cancel(
    alloc_id: int,
    ctx: Annotated[Ctx, Depends(requires(Action.ALLOCATION_CANCEL))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> AllocationOut:
    return allocations.cancel(ctx, alloc_id, hub)


@router.get(
    "/allocations/{alloc_id}/logs",
    summary="A job's stdout and stderr from per-stream offsets (long-poll with wait)",
)
async def read_logs(
    alloc_id: int,
    ctx: Annotated[Ctx, Depends(requires(Action.ALLOCATION_GET))],
    hub: Annotated[Hub, Depends(get_hub)],
    stdout: Annotated[int, Query(ge=0, le=2**62, description="Bytes of stdout already read.")] = 0,
    stderr: Annotated[int, Query(ge=0, le=2**62, description="Bytes of stderr already read.")] = 0,
    rank: Annotated[
        int, Query(ge=0, le=MAX_ID, description="Which gang member's output (0 = the first node).")
    ] = 0,
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, description="Seconds to wait for new output.")] = 0,
) -> LogsOut:
    offsets = {"stdout": stdout, "stderr": stderr}
    return await long_poll(
        hub,
        topics.logs(alloc_id),
        wait,
        lambda: allocations.read_log(ctx, alloc_id, rank, offsets),
        lambda out: bool(out.stdout.data or out.stderr.data or out.ended),
    )
