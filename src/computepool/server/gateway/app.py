"""The gateway on its own (`cpool gateway`): /healthz, /readyz and /v1 over a shared database.

It neither migrates nor schedules: the control plane owns the schema, and starts replicas when
this gateway's load reports show requests waiting.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from computepool.server.caches import TokenCache
from computepool.server.gateway.core import Gateway
from computepool.server.gateway.router import MAX_BODY_BYTES, router
from computepool.server.loops import Loops
from computepool.store.db import Database

DEFAULT_LIMIT = (3000, 500)  # as `cpool server`'s --gateway-rpm and --gateway-burst


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    gateway: Gateway = app.state.gateway
    await gateway.start()
    loops = Loops(gateway.periodic())
    loops.start()
    try:
        yield
    finally:
        await loops.stop()
        await gateway.stop()
        app.state.db.dispose()


def create_gateway_app(
    db_url: str,
    token_cache_s: float = 1.0,
    max_body_bytes: int = MAX_BODY_BYTES,
    default_limit: tuple[int, int] | None = DEFAULT_LIMIT,
) -> FastAPI:
    """`default_limit`: (requests a minute, burst) of a tenant with no gateway limit of its own."""
    app = FastAPI(title="ComputePool gateway", lifespan=_lifespan, openapi_url="/openapi.json")
    app.state.max_body_bytes = max_body_bytes  # request bodies; larger ones answer 413
    app.state.db = Database(db_url)
    app.state.gateway = Gateway(app.state.db, TokenCache(token_cache_s), default_limit)

    @app.get("/healthz", summary="The process is alive (does not touch the database)")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="The database is reachable")
    async def readyz(request: Request) -> JSONResponse:
        try:
            await run_in_threadpool(request.app.state.db.ping)
        except Exception as e:  # any failure to reach the database means "not ready"
            body = {"status": "unavailable", "error": f"database unreachable ({type(e).__name__})"}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "2"})
        return JSONResponse({"status": "ready", "gateway": request.app.state.gateway.id})

    app.include_router(router)
    return app
