"""Remote Python functions: register, list, delete, calls, results (long-poll), and the worker's routes."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool

from computepool.server import topics
from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.hub import Hub
from computepool.server.logic import function_workers, functions
from computepool.server.logic.function_handoff import Handoff, Waiter, Watch
from computepool.server.policy import Action
from computepool.server.routers.answer import answer
from computepool.server.routers.polling import RECHECK_S, long_poll
from computepool.wire.common import Items
from computepool.wire.functions import (
    CallIds,
    CallOut,
    CallsIn,
    ClaimIn,
    ClaimOut,
    Done,
    FunctionCreate,
    FunctionOut,
    NextCall,
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
LARGE_BODIES = re.compile(r"^/api/v1/(functions/[0-9]+/calls|worker/next|worker/calls)$")
LARGE_BODY_BYTES = 96 << 20
SETTLE_S = 0.02  # a results poll over several calls, once woken, gathers for this long


def _parts(request: Request) -> tuple[Hub, Handoff]:
    """The app's hub and handoff, read here rather than as dependencies: FastAPI resolves each
    dependency on every request, and these routes are on every call's path."""
    state = request.app.state
    return state.hub, state.handoff


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
    request: Request,
) -> FunctionOut:
    return functions.delete(ctx, fid, _parts(request)[0])


@router.post(
    "/functions/{fid}/calls",
    response_model=CallIds,
    summary="Submit 1..1000 calls; answers their ids (and, with wait_s, the news of those that ended)",
)
async def submit(
    fid: int,
    body: CallsIn,
    ctx: Annotated[Ctx, Depends(requires(Action.FUNCTION_CALL))],
    request: Request,
    response: Response,
) -> Response:
    return answer(await _submit(fid, body, ctx, request), response)


async def _submit(fid: int, body: CallsIn, ctx: Ctx, request: Request) -> CallIds:
    hub, handoff = _parts(request)
    if body.wait_s <= 0:
        return await run_in_threadpool(functions.submit, ctx, fid, body, hub, handoff)
    deadline = time.monotonic() + body.wait_s
    topic = topics.fn_results(fid)
    loop = asyncio.get_running_loop()
    # one call (`.remote()`): the hand-in that ends it on this replica gives us its row
    watch = Watch(loop, loop.create_future()) if len(body.calls) == 1 else None
    ev = hub.subscribe(topic)  # before the calls exist: no result can come before the wait
    try:
        out = await run_in_threadpool(functions.submit, ctx, fid, body, hub, handoff, watch)
        if watch is None or watch.call:  # else sent again: its calls may have ended, read at once
            futures: list[asyncio.Future[Any]] = [asyncio.ensure_future(ev.wait())]
            if watch is not None:
                futures.append(watch.future)
            try:
                left = max(0.0, min(deadline - time.monotonic(), RECHECK_S))
                await asyncio.wait(futures, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                futures[0].cancel()
            if watch is not None and watch.future.done():
                calls = functions.outcome(watch.future.result())
                if calls:
                    return out.model_copy(update={"calls": calls})
    finally:
        if watch is not None:
            handoff.unwatch(watch)
        hub.unsubscribe(topic, ev)
    news = await long_poll(
        hub,
        topic,
        max(0.0, deadline - time.monotonic()),
        lambda: functions.news(ctx, fid, out.ids),
        lambda got: bool(got.calls),
        settle_s=SETTLE_S if len(out.ids) > 1 else 0.0,
    )
    return out.model_copy(update={"calls": news.calls})


@router.post(
    "/functions/{fid}/results",
    response_model=ResultsOut,
    summary="Calls among ids that ended or printed past their offset (long-poll up to wait_s)",
)
async def results(
    fid: int,
    body: ResultsIn,
    ctx: Annotated[Ctx, Depends(requires(Action.FUNCTION_RESULTS))],
    request: Request,
    response: Response,
) -> Response:
    out = await long_poll(
        _parts(request)[0],
        topics.fn_results(fid),
        body.wait_s,
        lambda: functions.results(ctx, fid, body),
        lambda out: bool(out.calls),
        settle_s=SETTLE_S if len(body.ids) > 1 else 0.0,
    )
    return answer(out, response)


@router.delete("/functions/{fid}/calls/{cid}", summary="Cancel a call (a running one ends its worker)")
def cancel_call(
    fid: int,
    cid: int,
    ctx: Annotated[Ctx, Depends(requires(Action.FUNCTION_CALL_CANCEL))],
    request: Request,
) -> CallOut:
    return functions.cancel_call(ctx, fid, cid, _parts(request)[0])


@router.post(
    "/worker/next",
    response_model=NextOut,
    summary="A worker hands in its result and takes the next call (long-poll)",
)
async def worker_next(
    body: NextIn,
    ctx: Annotated[Ctx, Depends(requires(Action.WORKER_NEXT))],
    request: Request,
    response: Response,
) -> Response:
    done = [body.done] if body.done is not None else []
    out = await _claim(ctx, *_parts(request), done, 1, body.wait_s)
    return answer(NextOut(call=out.calls[0] if out.calls else None, stop=out.stop), response)


@router.post(
    "/worker/calls",
    response_model=ClaimOut,
    summary="A worker hands in its results and claims up to max_calls calls (long-poll)",
)
async def worker_calls(
    body: ClaimIn,
    ctx: Annotated[Ctx, Depends(requires(Action.WORKER_NEXT))],
    request: Request,
    response: Response,
) -> Response:
    out = await _claim(ctx, *_parts(request), body.done, body.max_calls, body.wait_s, body.holding)
    return answer(out, response)


async def _claim(
    ctx: Ctx,
    hub: Hub,
    handoff: Handoff,
    done: list[Done],
    max_calls: int,
    wait_s: float,
    holding: list[int] | None = None,
) -> ClaimOut:
    """Hand in, claim; with nothing to claim, park until a submission on this replica hands calls
    over, the queue's topic wakes it (then read the queue), or the wait ends."""
    worker, fid = function_workers.worker_of(ctx)
    topic = topics.fn_calls(fid)
    ev = hub.subscribe(topic)  # before the first read: a call queued after it still wakes this poll
    try:
        out = await run_in_threadpool(
            function_workers.claim_calls, ctx, done, max_calls, hub, holding or [], handoff
        )
        if out.calls or out.stop or wait_s <= 0 or max_calls == 0:
            return out
        deadline = time.monotonic() + wait_s
        loop = asyncio.get_running_loop()
        while True:
            waiter = Waiter(worker, max_calls, loop, loop.create_future())
            handoff.park(fid, waiter)
            woken = asyncio.ensure_future(ev.wait())
            try:
                left = deadline - time.monotonic()
                if not ev.is_set() and left > 0:
                    both: list[asyncio.Future[Any]] = [waiter.future, woken]
                    await asyncio.wait(
                        both,
                        timeout=min(left, RECHECK_S),
                        return_when=asyncio.FIRST_COMPLETED,
                    )
            finally:
                woken.cancel()
                taken = not handoff.withdraw(fid, waiter)
            if taken:  # a submission claimed calls for this worker: its answer is on the way
                calls = await waiter.future
                if calls:
                    return ClaimOut(calls=[NextCall(id=i, args=a) for i, a in calls], stop=False)
            ev.clear()
            out = await run_in_threadpool(function_workers.claim, ctx, hub, max_calls)
            if out.calls or out.stop or time.monotonic() >= deadline:
                return out
    finally:
        hub.unsubscribe(topic, ev)


@router.post("/worker/output", summary="A worker appends printed output to the call it runs")
def worker_output(
    body: OutputIn,
    ctx: Annotated[Ctx, Depends(requires(Action.WORKER_OUTPUT))],
    request: Request,
) -> OutputOut:
    return function_workers.output(ctx, body, _parts(request)[0])
