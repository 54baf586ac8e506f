"""Liveness (no database) and readiness (the database answers; and whether this replica schedules)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="The process is alive (does not touch the database)")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="The database is reachable", responses={503: {"description": "Database down"}})
def readyz(request: Request) -> JSONResponse:
    try:
        request.app.state.db.ping()
    except Exception as e:  # any failure to reach the database means "not ready"
        return JSONResponse(
            {"status": "unavailable", "error": f"database unreachable ({type(e).__name__})"},
            status_code=503,
            headers={"Retry-After": str(request.app.state.settings.retry_after_s)},
        )
    # which replica schedules (the others serve the API and stand by for the lease)
    role = "leader" if request.app.state.controller.leader else "standby"
    state = request.app.state
    audit = "broken" if state.audit_problem else ("intact" if state.audit_checked else "checking")
    body = {"status": "ready", "scheduler": role, "audit": audit}
    if state.audit_problem:  # served anyway: a broken record is evidence, not a reason to stop the pool
        body["audit_error"] = state.audit_problem
    elif state.audit_anchor_behind:  # intact as far as checked, but the newest records are unanchored
        body["audit"] = "anchor-behind"
        body["audit_error"] = state.audit_anchor_behind
    return JSONResponse(body)
