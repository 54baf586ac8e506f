"""The node agent's side: its assignments (long-poll), process reports, and job output."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from computepool.server import topics
from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.hub import Hub
from computepool.server.logic import agent_reports
from computepool.server.policy import Action
from computepool.server.routers.allocations import MAX_WAIT_S, get_hub
from computepool.server.routers.answer import answer
from computepool.server.routers.polling import long_poll
from computepool.wire.allocation_out import Assignments, LogAppended, LogChunk, Reports, ReportsOut

router = APIRouter(tags=["agent"])


@router.get(
    "/nodes/{name}/assignments",
    response_model=Assignments,
    summary="The jobs this node should run (node credential; long-poll)",
)
async def assignments(
    name: str,
    response: Response,
    ctx: Annotated[Ctx, Depends(requires(Action.NODE_ASSIGNMENTS))],
    hub: Annotated[Hub, Depends(get_hub)],
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, description="Seconds to wait for a change.")] = 0,
    since: Annotated[int | None, Query(ge=0, lt=2**63, description="The version last seen.")] = None,
) -> Response:
    received = time.monotonic()

    def read() -> Assignments:  # stamped with how long the poll was held before this read
        held = time.monotonic() - received
        return agent_reports.assignments(ctx, name).model_copy(update={"held_s": int(held * 1000) / 1000})

    out = await long_poll(hub, topics.node(name), wait, read, lambda a: since is None or a.version != since)
    return answer(out, response)


@router.post(
    "/nodes/{name}/reports",
    response_model=ReportsOut,
    summary="Process states of this node's jobs (node credential)",
)
def reports(
    name: str,
    body: Reports,
    response: Response,
    ctx: Annotated[Ctx, Depends(requires(Action.NODE_REPORT))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> Response:
    return answer(agent_reports.report(ctx, name, body, hub), response)


@router.post(
    "/allocations/{alloc_id}/logs",
    response_model=LogAppended,
    summary="Append a chunk of a job's output (node credential)",
)
def append_logs(
    alloc_id: int,
    body: LogChunk,
    response: Response,
    ctx: Annotated[Ctx, Depends(requires(Action.NODE_LOG_APPEND))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> Response:
    return answer(agent_reports.append_log(ctx, alloc_id, body, hub), response)
