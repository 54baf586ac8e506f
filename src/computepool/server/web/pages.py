"""The dashboard's routes: sign-in and sign-out, one page shell per view, and the static assets.

Pages are server-rendered shells (the nav, who is signed in, the CSRF token); `static/app.js`
fills them from the JSON API under /api/v1 with the session cookie and refreshes them every two
seconds, so what a user sees is exactly what the API lets that user read.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from computepool.core.usage import UsageBy
from computepool.server.alerts import api as alerts_api
from computepool.server.context import Ctx
from computepool.server.errors import ApiError, NotFound
from computepool.server.logic import allocations, nodes, services, usage
from computepool.server.policy import Action, authorize
from computepool.server.web import board, explain, fmt, racks, spend, work
from computepool.server.web.session import (
    SECURITY_HEADERS,
    Refused,
    Session,
    check_token,
    close_session,
    current,
    form,
    open_session,
    same_origin,
)
from computepool.wire.alerts import AlertOut, AlertRuleIn, AlertRuleOut
from computepool.wire.allocation_out import AllocationOut
from computepool.wire.common import MAX_ID
from computepool.wire.nodes import NodeOut
from computepool.wire.usage import DeviceSampleOut, StaticEquivalentOut, UsageOut

T = TypeVar("T")
router = APIRouter(include_in_schema=False)
# name → (title, heading shown in the nav); the order is the nav's
PAGES: dict[str, str] = {
    "overview": "Overview",
    "nodes": "Nodes and devices",
    "work": "Work",
    "services": "Services",
    "tenants": "Tenants",
    "usage": "Usage",
    "alerts": "Alerts",
    "audit": "Audit",
}
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
_templates = Environment(
    loader=PackageLoader("computepool.server.web", "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)
_templates.filters.update(fmt.FILTERS)


def _html(template: str, status: int = 200, **context: Any) -> HTMLResponse:
    body = _templates.get_template(template).render(nav=PAGES, **context)
    return HTMLResponse(body, status_code=status, headers=SECURITY_HEADERS)


def _page(session: Session, page: str, status: int = 200, **context: Any) -> HTMLResponse:
    p = session.principal
    return _html(
        f"{page}.html",
        status,
        page=page,
        title=PAGES.get(page, "Work"),
        me={"name": p.name, "role": str(p.role), "tenant": p.tenant or ""},
        csrf=session.csrf,
        **context,
    )


def _sign_in(status: int = 200, error: str = "") -> HTMLResponse:
    return _html("login.html", status, page="login", title="Sign in", error=error)


def _to(path: str) -> RedirectResponse:
    return RedirectResponse(path, status_code=303, headers=SECURITY_HEADERS)


@router.get("/")
async def home(request: Request) -> Response:
    session = await current(request)
    return await _overview(request, session) if session else _sign_in()


@router.get("/ui")
@router.get("/ui/login")
async def to_home() -> Response:
    return _to("/")


@router.post("/ui/login")
async def login(request: Request) -> Response:
    if not same_origin(request):
        return _sign_in(403, "refused: the sign-in form was sent from another site")
    token = (await form(request)).get("token", "").strip()
    if not token:
        return _sign_in(401, "token refused: paste a pool token (<id>.<secret>)")
    try:
        session = await check_token(request, token)
    except Refused as e:
        return _sign_in(401, f"token refused: {e}")
    response = _to("/")
    open_session(response, request, session)
    return response


@router.post("/ui/logout")
async def logout(request: Request) -> Response:
    session = await current(request)
    if session is not None:  # the form carries the CSRF token: another site cannot sign you out
        given = (await form(request)).get("csrf", "").encode()
        if not (same_origin(request) and hmac.compare_digest(given, session.csrf.encode())):
            return _page(session, "overview", 403, error="sign-out refused: missing or wrong CSRF token")
    response = _to("/")
    close_session(response)
    return response


@router.get("/ui/static/{name}")
def asset(name: str) -> Response:
    """The dashboard's script and style, from the installed package (no CDN, works offline)."""
    if name not in ASSETS:
        return Response("not found", status_code=404, media_type="text/plain", headers=SECURITY_HEADERS)
    body = (resources.files("computepool.server.web") / "static" / name).read_bytes()
    return Response(body, media_type=ASSETS[name], headers={**SECURITY_HEADERS, "Cache-Control": "no-cache"})


@router.get("/ui/work/{alloc_id}")
async def allocation(request: Request, alloc_id: str) -> Response:
    """One allocation with its live logs; another tenant's answers 404 exactly like a missing one."""
    session = await current(request)
    if session is None:
        return _to("/")
    try:
        number = int(alloc_id) if alloc_id.isdigit() and len(alloc_id) <= 20 else 0
        if not 1 <= number <= MAX_ID:
            raise NotFound.of("allocation", alloc_id)
        authorize(session.principal, Action.ALLOCATION_GET)
        ctx = Ctx(
            db=request.app.state.db,
            settings=request.app.state.settings,
            action=Action.ALLOCATION_GET,
            request_id=request.state.request_id,
            principal=session.principal,
            caches=request.app.state.caches,
        )
        found = await run_in_threadpool(allocations.get, ctx, number)
        why = await run_in_threadpool(explain.explain, ctx, number) if found.state == "pending" else None
    except ApiError as e:
        return _page(session, "allocation", e.status, alloc_id=alloc_id, error=e.message)
    return _page(
        session, "allocation", alloc_id=number, a=found, why=why, quota=explain.quota_rows(why), error=""
    )


def _ctx(request: Request, session: Session, action: Action) -> Ctx:
    """The API's own context for a page's reads: the same authorization and tenant scoping."""
    authorize(session.principal, action)
    return Ctx(
        db=request.app.state.db,
        settings=request.app.state.settings,
        action=action,
        request_id=request.state.request_id,
        principal=session.principal,
        caches=request.app.state.caches,
    )


@router.get("/ui/work")
async def work_page(request: Request) -> Response:
    """Active and pending work by default, pending pinned on top; filters and search are query
    parameters (a plain GET form), so the page works without its script."""
    session = await current(request)
    if session is None:
        return _to("/")
    f = work.Filters.parse(dict(request.query_params))

    def read() -> work.WorkView:
        rows = _allocations(request, session)
        found = nodes.list_all(_ctx(request, session, Action.NODE_LIST))
        return work.build(rows, found.items, f)

    try:
        view = await run_in_threadpool(read)
    except ApiError as e:
        return _page(session, "work", e.status, error=e.message, view=None, states=work.STATES)
    return _page(session, "work", view=view, states=work.STATES, error="")


@router.get("/ui/services")
async def services_page(request: Request) -> Response:
    session = await current(request)
    if session is None:
        return _to("/")
    try:
        found = await run_in_threadpool(services.list_all, _ctx(request, session, Action.SERVICE_LIST))
    except ApiError as e:
        return _page(session, "services", e.status, error=e.message, services=[])
    return _page(session, "services", services=found.items, error="")


def _allocations(request: Request, session: Session) -> list[AllocationOut]:
    """The newest allocations the viewer may see, and every pending one however old (the queue
    is shown whole), read like GET /allocations."""
    ctx = _ctx(request, session, Action.ALLOCATION_LIST)
    newest = allocations.list_all(ctx, state=None, tenant=None, limit=work.MAX_ROWS).items
    waiting = allocations.list_all(ctx, state="pending", tenant=None, limit=work.MAX_ROWS).items
    seen = {a.id for a in newest}
    return newest + [a for a in waiting if a.id not in seen]


def _optional(read: Callable[[], T]) -> T | None:
    """A part of a page the viewer may lack (a 403 or 404 from its API): None, shown as a dash."""
    try:
        return read()
    except ApiError:
        return None


def _history(
    request: Request, session: Session, found: list[NodeOut], since: str
) -> dict[str, list[DeviceSampleOut]]:
    history: dict[str, list[DeviceSampleOut]] = {}
    for n in found:
        try:
            history[n.name] = usage.node_history(
                _ctx(request, session, Action.NODE_HISTORY_GET), n.name, since
            ).items
        except ApiError:
            continue
    return history


@router.get("/ui/nodes")
async def nodes_page(request: Request) -> Response:
    session = await current(request)
    if session is None:
        return _to("/")

    def read() -> list[racks.Rack]:
        found = nodes.list_all(_ctx(request, session, Action.NODE_LIST)).items
        rows = _allocations(request, session)
        return racks.build(found, rows, _history(request, session, found, "1h"))

    try:
        found = await run_in_threadpool(read)
    except ApiError as e:
        return _page(session, "nodes", e.status, error=e.message, racks=[])
    return _page(session, "nodes", racks=found, error="")


async def _overview(request: Request, session: Session) -> Response:
    def read() -> board.Overview:
        def ctx(action: Action) -> Ctx:
            return _ctx(request, session, action)

        found = nodes.list_all(ctx(Action.NODE_LIST)).items
        rows = _allocations(request, session)
        history = _history(request, session, found, "24h")
        used = _optional(lambda: usage.usage(ctx(Action.USAGE_LIST), "tenant", "1d", None).items)
        firing = _optional(lambda: alerts_api.list_alerts(ctx(Action.ALERT_LIST), "firing", None).items)
        return board.build(found, rows, history, used, firing)

    try:
        o = await run_in_threadpool(read)
    except ApiError as e:
        return _page(session, "overview", e.status, error=e.message, o=None)
    return _page(session, "overview", o=o, error="")


@router.get("/ui/overview")
async def overview_page(request: Request) -> Response:
    session = await current(request)
    return await _overview(request, session) if session else _to("/")


@dataclass(frozen=True)
class UsageView:
    by: str
    since: str
    rows: UsageOut | None
    static: StaticEquivalentOut | None
    start: datetime
    chart: Markup
    tenants: list[str]
    efficiency: list[spend.Efficiency]
    firing: list[AlertOut] | None
    rules: list[AlertRuleOut] | None


def _usage_choice(request: Request) -> tuple[UsageBy, str]:
    q = request.query_params
    return spend.grouping(q.get("by")), spend.window(q.get("since"))


@router.get("/ui/usage")
async def usage_page(request: Request) -> Response:
    """The ledger, its CSV, GPUs held per tenant over time, efficiency, savings over the observed
    window, and the firing alerts with their rules (silenced here by an admin)."""
    session = await current(request)
    if session is None:
        return _to("/")
    by, since = _usage_choice(request)

    def read() -> UsageView:
        def ctx(action: Action) -> Ctx:
            return _ctx(request, session, action)

        rows = _optional(lambda: usage.usage(ctx(Action.USAGE_LIST), by, since, None))
        static = _optional(lambda: usage.static_equivalent(ctx(Action.USAGE_STATIC_GET), since, None))
        allocs = _allocations(request, session)
        found = nodes.list_all(ctx(Action.NODE_LIST)).items
        now = datetime.now(UTC)
        start = static.since if static else now - timedelta(days=int(since[:-1]))
        start = min(start, now - timedelta(minutes=5))
        chart, tenants = spend.stacked(allocs, start, now)
        eff = spend.efficiency(allocs, _history(request, session, found, since), start, now)
        firing = _optional(lambda: alerts_api.list_alerts(ctx(Action.ALERT_LIST), "firing", None).items)
        rules = _optional(lambda: alerts_api.list_rules(ctx(Action.ALERT_RULE_LIST)).items)
        return UsageView(by, since, rows, static, start, chart, tenants, eff, firing, rules)

    try:
        view = await run_in_threadpool(read)
    except ApiError as e:
        return _page(session, "usage", e.status, error=e.message, u=None)
    return _page(
        session, "usage", u=view, keys=spend.KEYS, measures=spend.MEASURES, choices=spend.SINCE, error=""
    )


@router.get("/ui/usage.csv")
async def usage_csv(request: Request) -> Response:
    """The Usage table as a CSV download, with the same grouping, window and scope."""
    session = await current(request)
    if session is None:
        return _to("/")
    by, since = _usage_choice(request)
    try:
        rows = await run_in_threadpool(
            usage.usage,
            _ctx(request, session, Action.USAGE_LIST),
            by,
            since,
            None,
        )
    except ApiError as e:
        return Response(e.message, status_code=e.status, media_type="text/plain", headers=SECURITY_HEADERS)
    disposition = f'attachment; filename="usage-by-{by}-{since}.csv"'
    return Response(
        spend.csv_text(rows.items, by),
        media_type="text/csv; charset=utf-8",
        headers={**SECURITY_HEADERS, "Content-Disposition": disposition},
    )


@router.post("/ui/alert-rules/{rule}/{change}")
async def alert_rule(request: Request, rule: str, change: str) -> Response:
    """Silence (turn off) or turn on an alert rule from the page: the API's own rule change, so it
    is for admins and lands in the audit log; the form carries the CSRF token."""
    session = await current(request)
    if session is None:
        return _to("/")
    if change not in ("silence", "enable"):
        return _page(session, "missing", 404, error=f"no action '{change}' on alert rules")
    given = (await form(request)).get("csrf", "").encode()
    if not (same_origin(request) and hmac.compare_digest(given, session.csrf.encode())):
        return _page(session, "missing", 403, error="refused: missing or wrong CSRF token")
    try:
        ctx = _ctx(request, session, Action.ALERT_RULE_SET)
        await run_in_threadpool(alerts_api.set_rule, ctx, rule, AlertRuleIn(enabled=change == "enable"))
    except ApiError as e:
        return _page(session, "missing", e.status, error=e.message)
    return _to("/ui/usage#usage-alerts")


@router.get("/ui/{page}")
async def view(request: Request, page: str) -> Response:
    session = await current(request)
    if session is None:
        return _to("/")
    if page not in PAGES:
        return _page(session, "missing", 404, error=f"page '{page}' not found")
    return _page(session, page)
