"""The app factory: settings and database on `app.state`, routers mounted, errors shaped.

Next parts add their routers to `routers.api_routers()`; background loops (scheduling,
node health) belong in `lifespan`, started after migrations and stopped before the engine closes.
The scheduling controller (`services.scheduling.Controller`) is on `app.state.controller`, the
wake-up hub on `app.state.hub`, the Prometheus registry on `app.state.metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool

from computepool.server import metrics
from computepool.server.errors import ApiError, install_handlers
from computepool.server.hub import Hub
from computepool.server.policy import Action
from computepool.server.routers import api_routers, health
from computepool.server.services.audit import record_refusal
from computepool.server.services.bootstrap import ensure_admin
from computepool.server.services.scheduling import Controller
from computepool.server.settings import ServerSettings
from computepool.store.db import Database
from computepool.store.migrate import upgrade

API_PREFIX = "/api/v1"


def _version() -> str:
    try:
        return version("computepool")
    except PackageNotFoundError:
        return "0+unknown"


STARTUP_DB_WAIT_S = 30.0
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
log = logging.getLogger("computepool.server")
_NO_WAKE = ("/heartbeat", "/logs")  # frequent telemetry; never changes a scheduling decision


def _prepare_data_dir(settings: ServerSettings) -> None:
    settings.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)


def _migrate_and_bootstrap(db: Database, settings: ServerSettings) -> None:
    """Wait a while for the database (it may start after us), then migrate and bootstrap."""
    deadline = time.monotonic() + STARTUP_DB_WAIT_S
    while True:
        try:
            db.ping()
            break
        except Exception as e:  # reported, then retried until the deadline
            if time.monotonic() > deadline:
                raise RuntimeError(f"database unreachable at start: {e}") from e
            log.warning("database not reachable yet (%s); retrying", type(e).__name__)
            time.sleep(1.0)
    upgrade(db)
    ensure_admin(db, settings.admin_token_path)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: ServerSettings = app.state.settings
    db: Database = app.state.db
    _prepare_data_dir(settings)
    await run_in_threadpool(_migrate_and_bootstrap, db, settings)
    hub: Hub = app.state.hub
    controller: Controller = app.state.controller
    hub.attach(asyncio.get_running_loop())
    controller.start()
    log.info("control plane ready (database: %s)", db.dialect)
    try:
        yield
    finally:
        await controller.stop()
        db.dispose()


def create_app(settings: ServerSettings) -> FastAPI:
    """Build the app. Migrations and the first admin happen at startup (lifespan), not here."""
    app = FastAPI(
        title="ComputePool control plane",
        version=_version(),
        lifespan=_lifespan,
        openapi_url="/openapi.json",
    )
    app.state.settings = settings
    app.state.db = Database(settings.database_url)
    app.state.hub = Hub()
    app.state.metrics = metrics.Metrics(app.state.db, settings)
    app.state.controller = Controller(
        app.state.db, settings, app.state.hub, observe=app.state.metrics.cycle_seconds.observe
    )

    @app.middleware("http")
    async def request_id(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        given = request.headers.get("x-request-id", "")
        request.state.request_id = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        started = time.perf_counter()
        response = await call_next(request)
        response.headers["X-Request-ID"] = request.state.request_id
        route = request.scope.get("route")
        template = getattr(route, "path", "unmatched")
        app.state.metrics.api_seconds.labels(request.method, template, str(response.status_code)).observe(
            time.perf_counter() - started
        )
        if request.method != "GET" and response.status_code < 400 and not template.endswith(_NO_WAKE):
            app.state.hub.wake_scheduler()  # joins, cordons, quotas, weights may change decisions
        return response

    async def on_denied(request: Request, exc: ApiError) -> None:
        action = getattr(request.state, "action", None)
        if isinstance(action, Action) and action.mutating:
            await run_in_threadpool(
                record_refusal,
                request.app.state.db,
                getattr(request.state, "principal", None),
                action,
                request.url.path,
                request.state.request_id,
                exc,
            )

    install_handlers(app, on_denied)
    app.include_router(health.router)
    app.include_router(metrics.router)
    for router in api_routers():
        app.include_router(router, prefix=API_PREFIX)
    return app
