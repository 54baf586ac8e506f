"""Relay sessions (`cpool exec`, `cpool forward`): who may open one, the one-time secrets of its two
sockets, and the meeting point on a replica where the user's socket and the agent's are joined.

A user asks (POST) for a session into a running job it may see; the row names the node, the
attempt and the replica that answered (its advertised URL), and holds two secrets: the user's
(stored hashed) and the node's (handed to that node's agent in its relay long-poll, wiped when
used). Both sockets must come to that replica within SESSION_TTL, each secret works once, and a
node's credential opens only sessions on its own node. The server never runs anything for a
session: it passes frames between the two sockets until either closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, delete, or_, select

from computepool.server.context import Ctx
from computepool.server.credentials import hash_secret, secret_matches
from computepool.server.errors import Conflict, Forbidden, Invalid, NotFound, Unauthorized
from computepool.server.hub import Hub
from computepool.server.logic.audit import record
from computepool.server.policy import Principal, Role, Target, authorize
from computepool.store import allocations as alloc_store
from computepool.store import nodes as node_store
from computepool.store.db import Database, db_now
from computepool.store.models import RelaySession, Tenant
from computepool.wire.common import MAX_ID
from computepool.wire.relay import PendingRelay, PendingRelays, RelayCreate, RelayOut

SESSION_TTL = timedelta(seconds=30)  # both sockets must arrive within this
MAX_OPEN_PER_ALLOCATION = 64  # sessions pending or open into one job


def topic(node: str) -> str:
    """A node has a new session to dial back to (its relay long-poll)."""
    return f"relay:{node}"


def create(ctx: Ctx, alloc_id: int, body: RelayCreate, hub: Hub, replica: str | None) -> RelayOut:
    """A session into allocation `alloc_id`'s running job (409 when it runs none, 422 on bad input)."""
    if body.kind == "exec" and not body.command:
        raise Invalid("command: give the command to run, e.g. `-- bash`", "command")
    if body.kind == "forward" and not 1 <= body.port <= 65535:
        raise Invalid(f"port: {body.port} is not a TCP port (1-65535)", "port")
    with ctx.db.write() as s:
        a = alloc_store.get(s, alloc_id)
        if a is None:
            raise NotFound.of("allocation", alloc_id)
        authorize(ctx.caller(), ctx.action, Target("allocation", str(alloc_id), tenant=a.tenant.name))
        if a.command is None:
            raise Conflict(f"allocation {alloc_id} runs no job: there is nothing to {body.kind} into")
        if a.state != "active":
            raise Conflict(f"allocation {alloc_id} is {a.state}, not running: its job must be running")
        members = list(dict.fromkeys(a.nodes))
        if body.rank >= len(members):
            raise Invalid(f"rank: {body.rank} is past the last member (the job has {len(members)})", "rank")
        node = members[body.rank]
        if node_store.get(s, node) is None:
            raise Conflict(f"node {node}, where the job ran, has left the pool")
        now = db_now(s)
        if body.check:
            return RelayOut(
                id=0, allocation_id=a.id, node=node, rank=body.rank, secret="", url=replica, expires_in_s=0
            )
        s.execute(  # the job's ended sessions and those nobody opened (the audit log keeps who asked)
            delete(RelaySession).where(
                RelaySession.allocation_id == a.id,
                RelaySession.state != "open",
                or_(RelaySession.state == "closed", RelaySession.expires_at <= now - SESSION_TTL),
            )
        )
        live = s.scalars(
            select(RelaySession.id).where(
                RelaySession.allocation_id == a.id,
                or_(
                    RelaySession.state == "open",
                    and_(RelaySession.state == "pending", RelaySession.expires_at > now),
                ),
            )
        ).all()
        if len(live) >= MAX_OPEN_PER_ALLOCATION:
            raise Conflict(
                f"allocation {alloc_id} has {len(live)} shells and connections open, the most one job may "
                f"have ({MAX_OPEN_PER_ALLOCATION})"
            )
        client_secret = secrets.token_urlsafe(32)
        row = RelaySession(
            allocation_id=a.id, tenant_id=a.tenant_id, attempt=a.attempt, node=node, rank=body.rank,
            kind=body.kind, command=list(body.command), tty=body.tty, rows=body.rows, cols=body.cols,
            port=body.port, created_by=ctx.caller().token_id, client_secret_hash=hash_secret(client_secret),
            node_secret=secrets.token_urlsafe(32), replica=replica, state="pending", created_at=now,
            expires_at=now + SESSION_TTL,
        )  # fmt: skip
        s.add(row)
        s.flush()
        what = {"exec": body.command[:1], "tty": body.tty} if body.kind == "exec" else {"port": body.port}
        detail: dict[str, Any] = {body.kind: what, "rank": body.rank, "session": row.id}
        record(s, ctx, f"allocation:{alloc_id}", tenant=a.tenant.name, detail=detail, now=now)
        out = RelayOut(
            id=row.id, allocation_id=a.id, node=node, rank=body.rank, secret=client_secret, url=replica,
            expires_in_s=SESSION_TTL.total_seconds(),
        )  # fmt: skip
    hub.notify(topic(node))
    return out


def pending_for(ctx: Ctx, name: str, since: int) -> PendingRelays:
    """The node's sessions past id `since` that wait for its agent (they carry the node's secret)."""
    authorize(ctx.caller(), ctx.action, Target("node", name, node=name))
    with ctx.db.read() as s:
        now = db_now(s)
        rows = s.scalars(
            select(RelaySession).where(
                RelaySession.node == name,
                RelaySession.state == "pending",
                RelaySession.node_secret != "",
                RelaySession.expires_at > now,
                RelaySession.id > since,
            )
        ).all()
        names = {tid: tname for tid, tname in s.execute(select(Tenant.id, Tenant.name))} if rows else {}
        return PendingRelays(
            items=[
                PendingRelay(
                    id=r.id,
                    allocation_id=r.allocation_id,
                    attempt=r.attempt,
                    tenant=names[r.tenant_id],
                    kind="forward" if r.kind == "forward" else "exec",
                    command=list(r.command),
                    tty=r.tty,
                    rows=r.rows,
                    cols=r.cols,
                    port=r.port,
                    secret=r.node_secret,
                    url=r.replica,
                )  # fmt: skip
                for r in rows
            ]
        )


def claim(db: Database, principal: Principal, sid: int, secret: str, side: str) -> None:
    """Open session `sid`'s `side` ("client" or "node") for `principal`, once, before it expires.

    Every refusal of a session the caller could not open reads the same (404): its existence is
    not told to anyone but its user and its node."""
    missing = NotFound.of("relay session", sid)
    if not 1 <= sid <= MAX_ID:
        raise missing
    with db.write() as s:
        r = s.get(RelaySession, sid, with_for_update=True)
        if r is None:
            raise missing
        if side == "node":
            if principal.role is not Role.NODE or principal.node != r.node:
                raise missing
            if not r.node_secret or not hmac.compare_digest(r.node_secret, secret):
                raise missing
            r.node_secret = ""
        else:
            if principal.role is Role.NODE or principal.token_id != r.created_by:
                raise missing
            if not r.client_secret_hash or not secret_matches(secret, r.client_secret_hash):
                raise missing
            r.client_secret_hash = ""
        now = db_now(s)
        if r.state == "closed" or r.expires_at <= now:
            raise Conflict(f"relay session {sid} has expired")
        if side == "node":
            r.state = "open"


def end(db: Database, sid: int) -> None:
    """The session is over: nothing opens it again."""
    with db.write() as s:
        r = s.get(RelaySession, sid)
        if r is not None and r.state != "closed":
            r.state, r.node_secret, r.client_secret_hash = "closed", "", ""
            r.ended_at = db_now(s)


def authenticate_socket(principal: Principal | None) -> Principal:
    if principal is None:
        raise Unauthorized("missing bearer token")
    if principal.role not in (Role.NODE, Role.ADMIN, Role.TENANT_ADMIN, Role.MEMBER):
        raise Forbidden(f"a {principal.role} may not open shells or connections into jobs")
    return principal


@dataclass
class _Meeting:
    """Where session's two sockets meet on this replica."""

    sockets: dict[str, asyncio.Future[Any]] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Meetings:
    """The sessions whose sockets this replica holds (one per app, on its event loop)."""

    def __init__(self) -> None:
        self._open: dict[int, _Meeting] = {}

    def _get(self, sid: int) -> _Meeting:
        m = self._open.get(sid)
        if m is None:
            m = self._open[sid] = _Meeting()
            loop = asyncio.get_running_loop()
            m.sockets = {"client": loop.create_future(), "node": loop.create_future()}
        return m

    async def meet(self, sid: int, side: str, sock: Any, wait_s: float) -> Any | None:
        """Hand in this side's socket; the other side's, or None when it did not come in `wait_s`.

        The client's side then relays (and sets `done`); the node's waits for `done` (`hold`)."""
        m = self._get(sid)
        m.sockets[side].set_result(sock)
        other = m.sockets["node" if side == "client" else "client"]
        try:
            return await asyncio.wait_for(asyncio.shield(other), wait_s)
        except TimeoutError:
            self.finish(sid)
            return None

    async def hold(self, sid: int) -> None:
        m = self._open.get(sid)
        if m is not None:
            await m.done.wait()

    def finish(self, sid: int) -> None:
        m = self._open.pop(sid, None)
        if m is not None:
            m.done.set()
            for f in m.sockets.values():
                if not f.done():
                    f.cancel()
                else:
                    with contextlib.suppress(asyncio.CancelledError):
                        f.result()
