"""The node agent's side: its assignments (long-poll), process reports, and job output."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from computepool.server import topics
from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.hub import Hub
from computepool.server.logic import agent_reports
from computepool.server.policy import Action
from computepool.server.routers.allocations import MAX_WAIT_S, get_hub
from computepool.server.routers.polling import long_poll
from computepool.wire.allocation_out import Assignments, LogAppended, LogChunk, Reports, ReportsOut

router = APIRouter(tags=["agent"])


@router.get("/nodes/{name}/assignments", summary="The jobs this node should run (node credential; long-poll)")
async def assignments(
    name: str,
    ctx: Annotated[Ctx, Depends(requires(Action.NODE_ASSIGNMENTS))],
    hub: Annotated[Hub, Depends(get_hub)],
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, description="Seconds to wait for a change.")] = 0,
    since: Annotated[int | None, Query(ge=0, lt=2**63, description="The version last seen.")] = None,
) -> Assignments:
    received = time.monotonic()

    def read() -> Assignments:  # stamped with how long the poll was held before this read
        held = time.monotonic() - received
        return agent_reports.assignments(ctx, name).model_copy(update={"held_s": int(held * 1000) / 1000})

    return await long_poll(
        hub, topics.node(name), wait, read, lambda out: since is None or out.version != since
    )


@router.post("/nodes/{name}/reports", summary="Process states of this node's jobs (node credential)")
def reports(
    name: str,
    body: Reports,
    ctx: Annotated[Ctx, Depends(requires(Action.NODE_REPORT))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> ReportsOut:
    return agent_reports.report(ctx, name, body, hub)


@router.post("/allocations/{alloc_id}/logs", summary="Append a chunk of a job's output (node credential)")
def append_logs(
    alloc_id: int,
    body: LogChunk,
    ctx: Annotated[Ctx, Depends(requires(Action.NODE_LOG_APPEND))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> LogAppended:
    return agent_reports.append_log(ctx, alloc_id, body, hub)
