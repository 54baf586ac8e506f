"""Measured speeds of job types on device models (what the scheduler's speed preference uses)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query

from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.logic import throughputs
from computepool.server.policy import Action
from computepool.wire.common import Items
from computepool.wire.throughputs import ThroughputOut

router = APIRouter(tags=["throughputs"])


@router.get("/throughputs", summary="Measured steps/s per job type, device model and device count")
def list_throughputs(
    ctx: Annotated[Ctx, Depends(requires(Action.THROUGHPUT_LIST))],
    job_type: Annotated[
        str | None, Query(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$", description="Only this job type.")
    ] = None,
) -> Items[ThroughputOut]:
    return throughputs.list_all(ctx, job_type)
