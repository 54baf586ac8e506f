"""Remote Python functions: register, list, delete, calls, results (long-poll), and the worker's routes."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool

from computepool.server import topics
from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.hub import Hub
from computepool.server.logic import function_workers, functions
from computepool.server.policy import Action
from computepool.server.routers.polling import long_poll
from computepool.wire.common import Items
from computepool.wire.functions import (
    CallIds,
    CallOut,
    CallsIn,
    FunctionCreate,
    FunctionOut,
    NextIn,
    NextOut,
    OutputIn,
    OutputOut,
    ResultsIn,
    ResultsOut,
)

router = APIRouter(tags=["functions"])
# Bodies that carry pickled arguments or results may pass the server's general body cap, up to this;
# each argument and result has its own cap in the schema.
LARGE_BODIES = re.compile(r"^/api/v1/(functions/[0-9]+/calls|worker/next)$")
LARGE_BODY_BYTES = 96 << 20
SETTLE_S = 0.02  # a results poll over several calls, once woken, gathers for this long


def get_hub(request: Request) -> Hub:
    hub: Hub = request.app.state.hub
    return hub


@router.post(
    "/functions",
    status_code=201,
    summary="Register a function (201; 200 with the same id when this tenant registered the same spec)",
    responses={200: {"description": "The function registered earlier with the same spec"}},
)
def register(
    body: FunctionCreate, response: Response, ctx: Annotated[Ctx, Depends(requires(Action.FUNCTION_CREATE))]
) -> FunctionOut:
    out, created = functions.register(ctx, body)
    response.status_code = 201 if created else 200
    return out


@router.get("/functions", summary="The functions of the caller's tenant (admins: all)")
def list_functions(ctx: Annotated[Ctx, Depends(requires(Action.FUNCTION_LIST))]) -> Items[FunctionOut]:
    return functions.list_all(ctx)


@router.get("/functions/{fid}", summary="One function, with its live workers and waiting calls")
def get_function(fid: int, ctx: Annotated[Ctx, Depends(requires(Action.FUNCTION_GET))]) -> FunctionOut:
    return functions.get(ctx, fid)


@router.delete("/functions/{fid}", summary="Delete a function: its calls and workers are cancelled")
def delete_function(
    fid: int,
    ctx: Annotated[Ctx, Depends(requires(Action.FUNCTION_DELETE))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> FunctionOut:
    return functions.delete(ctx, fid, hub)


@router.post("/functions/{fid}/calls", summary="Submit 1..1000 calls; answers their ids")
def submit(
    fid: int,
    body: CallsIn,
    ctx: Annotated[Ctx, Depends(requires(Action.FUNCTION_CALL))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> CallIds:
    return functions.submit(ctx, fid, body, hub)


@router.post(
    "/functions/{fid}/results",
    summary="Calls among ids that ended or printed past their offset (long-poll up to wait_s)",
)
async def results(
    fid: int,
    body: ResultsIn,
    ctx: Annotated[Ctx, Depends(requires(Action.FUNCTION_RESULTS))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> ResultsOut:
    return await long_poll(
        hub,
        topics.fn_results(fid),
        body.wait_s,
        lambda: functions.results(ctx, fid, body),
        lambda out: bool(out.calls),
        settle_s=SETTLE_S if len(body.ids) > 1 else 0.0,
    )


@router.delete("/functions/{fid}/calls/{cid}", summary="Cancel a call (a running one ends its worker)")
def cancel_call(
    fid: int,
    cid: int,
    ctx: Annotated[Ctx, Depends(requires(Action.FUNCTION_CALL_CANCEL))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> CallOut:
    return functions.cancel_call(ctx, fid, cid, hub)


@router.post("/worker/next", summary="A worker hands in its result and takes the next call (long-poll)")
async def worker_next(
    body: NextIn,
    ctx: Annotated[Ctx, Depends(requires(Action.WORKER_NEXT))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> NextOut:
    first = await run_in_threadpool(function_workers.next_call, ctx, body.done, hub)
    if first.call is not None or first.stop or body.wait_s <= 0:
        return first
    fid = ctx.caller().function
    return await long_poll(
        hub,
        topics.fn_calls(int(fid or 0)),
        body.wait_s,
        lambda: function_workers.claim(ctx, hub),
        lambda out: out.call is not None or out.stop,
    )


@router.post("/worker/output", summary="A worker appends printed output to the call it runs")
def worker_output(
    body: OutputIn,
    ctx: Annotated[Ctx, Depends(requires(Action.WORKER_OUTPUT))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> OutputOut:
    return function_workers.output(ctx, body, hub)
