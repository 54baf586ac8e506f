"""The app factory: settings and database on `app.state`, routers mounted, errors shaped.

Next parts add their routers to `routers.api_routers()`; background loops (scheduling,
node health) belong in `lifespan`, started after migrations and stopped before the engine closes.
The scheduling controller (`scheduling.Controller`) is on `app.state.controller`, the
wake-up hub on `app.state.hub`, the Prometheus registry on `app.state.metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

import anyio
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from starlette.datastructures import State
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from computepool.server import metrics, secret_box, web
from computepool.server.alerts import AlertEngine
from computepool.server.caches import Caches
from computepool.server.coop.controller import CoopController
from computepool.server.errors import ApiError, install_handlers
from computepool.server.gateway import Gateway
from computepool.server.gateway import router as gateway_router
from computepool.server.hub import Hub
from computepool.server.leadership import Leadership
from computepool.server.ledger import Accountant
from computepool.server.limits import TokenBuckets, capped_receive, too_large
from computepool.server.logic import audit as audit_checks
from computepool.server.logic.audit import record_refusal
from computepool.server.logic.bootstrap import ensure_admin
from computepool.server.logic.function_handoff import Handoff
from computepool.server.logic.function_workers import Sweeper
from computepool.server.logic.log_limits import LogLimits
from computepool.server.logic.relay import Meetings
from computepool.server.logic.service_controller import ServiceController
from computepool.server.loops import Loops, Periodic
from computepool.server.outage import OutageNotes
from computepool.server.policy import Action
from computepool.server.reclaim import Reclaimer
from computepool.server.replicas import Replicas
from computepool.server.routers import api_routers, health
from computepool.server.routers.blobs import RAW_UPLOADS
from computepool.server.routers.functions import LARGE_BODIES, LARGE_BODY_BYTES
from computepool.server.routers.relay import ws_router as relay_sockets
from computepool.server.scheduling import Controller
from computepool.server.settings import ServerSettings
from computepool.store.db import Database
from computepool.store.migrate import upgrade
from computepool.wire.common import build_all

API_PREFIX = "/api/v1"


def _version() -> str:
    try:
        return version("computepool")
    except PackageNotFoundError:
        return "0+unknown"


STARTUP_DB_WAIT_S = 30.0
CHECKPOINT_EVERY_S = 1.0
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
log = logging.getLogger("computepool.server")
# frequent telemetry and function traffic; never changes a scheduling decision (new workers wake it;
# agents' reports wake it themselves when a job ends or moves)
_NO_WAKE = (
    "/heartbeat", "/logs", "/reports", "/worker/next", "/worker/output", "/results", "/calls",
    "/completions", "/embeddings",  # the gateway's inference traffic
)  # fmt: skip


class RequestMiddleware:
    """Request id, API latency histogram and scheduler wake-ups, as plain ASGI.

    (Starlette's `BaseHTTPMiddleware` costs about a millisecond a request in extra tasks and
    streams; this is on every call, so it stays at the ASGI level.)
    """

    def __init__(self, app: ASGIApp, app_state: State) -> None:
        self.app = app
        self.state = app_state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = ""
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                given = v.decode("latin-1")
                break
        rid = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        started = time.perf_counter()
        status = 500
        limit: int = self.state.settings.max_body_bytes
        if scope["method"] == "PUT" and RAW_UPLOADS.match(scope["path"]):
            limit = 1 << 62  # raw blob bodies: streamed to disk, their own caps checked as they come
        elif scope["method"] == "POST" and LARGE_BODIES.match(scope["path"]):
            limit = max(limit, LARGE_BODY_BYTES)  # function arguments and results (their own caps)

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode())]
            await send(message)

        try:
            body_receive = await capped_receive(scope, receive, limit)
            if body_receive is None:
                await too_large(send_with_id, limit)
            else:
                await self.app(scope, body_receive, send_with_id)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", "unmatched")
            method = scope["method"]
            self.state.metrics.api_seconds.labels(method, template, str(status)).observe(
                time.perf_counter() - started
            )
            if method != "GET" and status < 400 and not template.endswith(_NO_WAKE):
                self.state.hub.wake_scheduler()  # joins, cordons, quotas, weights may change decisions


def _prepare_data_dir(settings: ServerSettings) -> None:
    settings.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    # nobody else may list or read it (0711 is kept where `cpool up` lets jobs pass to the agent's dir)
    os.chmod(settings.data_dir, stat.S_IMODE(settings.data_dir.stat().st_mode) & 0o711)


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
    audit_checks.prepare(db, settings.audit_key_path, settings.audit_anchor_path)
    secret_box.prepare(db, settings.secrets_key_path)  # made now, so replicas can be given a copy
    ensure_admin(db, settings.admin_token_path)


class _AuditWatcher:
    """The whole chain once at start (a broken one is logged loudly and shown in /readyz and the
    metrics, but the pool keeps serving), then the head against this server's anchor each second."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.watch = audit_checks.Watch(state.db, state.settings.audit_anchor_path)
        self.whole_checked = False

    def step(self) -> None:
        state = self.state
        problem: str | None = state.audit_problem
        if not self.whole_checked:
            self.whole_checked = True
            try:
                report = audit_checks.check_chain(state.db, state.settings.audit_anchor_path)
                problem = report.cause if not report.ok else None
            except Exception as e:  # the database away at start: the anchor checks below still run
                log.warning("audit chain not checked at start: %s", e)
        behind: str | None = None
        if problem is None:
            try:
                problem = self.watch.step()
            except audit_checks.AnchorUnreadable as e:
                problem = str(e)
            except audit_checks.AnchorBehind as e:
                behind = str(e)
            except Exception as e:  # the database away: the next round looks again
                log.debug("audit anchor not checked: %s", e)
                behind = state.audit_anchor_behind
        if behind is not None and state.audit_anchor_behind is None:
            log.error("%s; /readyz says so until it catches up", behind)
        elif behind is None and state.audit_anchor_behind is not None:
            log.warning("audit anchor caught up with the head")
        state.audit_anchor_behind = behind
        if problem is not None and state.audit_problem is None:
            log.error("AUDIT CHAIN NOT INTACT: %s; run `cpool audit verify`", problem)
        state.audit_problem, state.audit_checked = problem, True
        state.metrics.audit_intact.set(0 if problem else 1)


def _periodics(state: State) -> list[Periodic]:
    """Every background loop of the control plane, in one list."""
    loops = [
        state.controller.periodic(),
        state.reclaimer.periodic(),
        state.service_controller.periodic(),
        state.coop_controller.periodic(),
        *Sweeper(state.db, state.hub).periodic(),
        *state.gateway.periodic(),
        state.accountant.periodic(),
        LogLimits(state.db, state.settings).periodic(),
        *state.alert_engine.periodic(),
        Periodic("audit-watch", CHECKPOINT_EVERY_S, _AuditWatcher(state).step, first_at_start=True),
        state.replicas.periodic(),
    ]
    if state.db.dialect == "sqlite":  # the log folded back into the file, off the write path
        loops.append(Periodic("checkpoint", CHECKPOINT_EVERY_S, state.db.checkpoint, quiet=True))
    return loops


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state = app.state
    settings: ServerSettings = state.settings
    db: Database = state.db
    _prepare_data_dir(settings)
    await run_in_threadpool(_migrate_and_bootstrap, db, settings)
    state.hub.attach(asyncio.get_running_loop())
    # Sync routes run in worker threads. Forty of them (anyio's default) mostly contend for
    # the GIL and the database's write lock; a few keep the CPU as busy with far less switching.
    anyio.to_thread.current_default_thread_limiter().total_tokens = settings.worker_threads
    gateway: Gateway = state.gateway
    await gateway.start()
    alert_engine: AlertEngine = state.alert_engine
    alert_engine.start()
    loops = Loops(_periodics(state), state.leadership, state.outage)
    loops.start()
    log.info("control plane ready (database: %s)", db.dialect)
    try:
        yield
    finally:
        await loops.stop()
        await run_in_threadpool(state.replicas.withdraw)
        await alert_engine.stop()
        await gateway.stop()
        await state.coop_controller.stop()
        state.leadership.close()  # a standby takes over at once
        db.dispose()


def create_app(settings: ServerSettings) -> FastAPI:
    """Build the app. Migrations and the first admin happen at startup (lifespan), not here."""
    build_all()
    app = FastAPI(
        title="ComputePool control plane",
        version=_version(),
        lifespan=_lifespan,
        openapi_url="/openapi.json",
    )
    app.state.settings = settings
    app.state.db = Database(settings.database_url)
    app.state.audit_problem = None  # what is wrong with the audit chain, once a check found it
    app.state.audit_checked = False
    app.state.audit_anchor_behind = None  # why the anchor could not advance, while it cannot
    app.state.hub = Hub()
    app.state.handoff = Handoff()  # idle function workers parked here (see function_handoff)
    app.state.outage = OutageNotes()  # the database's outages, one line each (loops and API alike)
    app.state.caches = Caches.create(settings.token_cache_s, settings.shape_cache_s)
    app.state.metrics = metrics.Metrics(app.state.db, settings)
    app.state.leadership = leadership = Leadership(app.state.db)
    app.state.replicas = Replicas(app.state.db, settings)  # this replica's URL, the live ones
    app.state.controller = Controller(
        app.state.db,
        settings,
        app.state.hub,
        observe=app.state.metrics.cycle_seconds.observe,
        leadership=leadership,
    )
    app.state.reclaimer = Reclaimer(
        app.state.db, settings, app.state.hub, leadership, app.state.metrics.registry
    )
    app.state.service_controller = ServiceController(app.state.db, settings, app.state.hub, leadership)
    app.state.coop_controller = CoopController(app.state.db, settings, app.state.hub, leadership)

    default_limit = (settings.gateway_rpm, settings.gateway_burst)
    app.state.gateway = Gateway(app.state.db, app.state.caches.tokens, default_limit)  # /v1: server.gateway
    app.state.relay_meetings = Meetings()  # relay sessions' sockets held here (`cpool exec`)
    app.state.api_limits = TokenBuckets()  # the per-tenant API rate limit (limits.check_api_rate)
    app.state.accountant = Accountant(app.state.db, settings, app.state.hub, leadership)
    app.state.alert_engine = AlertEngine(
        app.state.db,
        settings,
        app.state.hub,
        leadership,
        audit_problem=lambda: app.state.audit_problem,
        replica_count=lambda: len(app.state.replicas.urls()),
    )

    app.add_middleware(RequestMiddleware, app_state=app.state)

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
    app.include_router(gateway_router)
    for router in api_routers():
        app.include_router(router, prefix=API_PREFIX)
    app.include_router(relay_sockets, prefix=API_PREFIX)  # WebSockets: they authenticate themselves
    app.include_router(web.router)  # the dashboard: / and /ui/… (last: the API's routes match first)
    return app
