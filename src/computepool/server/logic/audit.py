"""Audit helpers for services: record a change in the same transaction as the change itself.

Also the server's half of tamper evidence (see `store.audit`): the audit key (DATA_DIR/audit-key,
0600, made on first start, or `--audit-key-file` shared by replicas) that seals the head, and the
anchor file (DATA_DIR/audit-anchor, 0600) where this server notes, once a second, the last sealed
head it saw. A table that no longer reaches the anchor lost records from its end; a record at the
anchor with another hash means a rewritten tail.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from computepool.server import keyfile
from computepool.server.context import Ctx
from computepool.server.errors import ApiError
from computepool.server.policy import Action, Principal, authorize
from computepool.store import audit
from computepool.store.db import Database, db_now
from computepool.wire.audit import AuditOut, AuditVerifyOut
from computepool.wire.common import Items

log = logging.getLogger("computepool.server")


def record(
    session: Session,
    ctx: Ctx,
    target: str,
    *,
    tenant: str | None = None,
    outcome: str = "ok",
    actor: str | None = None,
    detail: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> None:
    """Append to the chain inside the caller's transaction: the change and its record commit together."""
    who = actor or (ctx.principal.actor if ctx.principal else "anonymous")
    event = audit.AuditEvent(
        actor=who,
        action=str(ctx.action),
        target=target,
        outcome=outcome,
        request_id=ctx.request_id,
        tenant=tenant,
        detail=detail or {},
    )
    audit.append(session, event, now if now is not None else db_now(session))


def record_refusal(
    db: Database, principal: Principal | None, action: Action, path: str, request_id: str, exc: ApiError
) -> None:
    """A refused state-changing call (403/404/409/422) gets its own record; failures here are logged only."""
    event = audit.AuditEvent(
        actor=principal.actor if principal else "anonymous",
        action=str(action),
        target=path,
        outcome=f"refused:{exc.status}",
        request_id=request_id,
        tenant=principal.tenant if principal else None,
        detail={"error": exc.message[:200]},
    )
    try:
        with db.write() as s:
            audit.append(s, event, db_now(s))
    except Exception as e:  # the refusal is answered anyway; the database may be the problem
        log.warning("could not audit a refused %s: %s", action, type(e).__name__)


def _out(r: audit.AuditRecord) -> AuditOut:
    return AuditOut(
        seq=r.seq,
        time=r.time,
        actor=r.actor,
        tenant=r.tenant,
        action=r.action,
        target=r.target,
        outcome=r.outcome,
        request_id=r.request_id,
        detail=r.detail,
        prev_hash=r.prev_hash,
        hash=r.hash,
    )


def list_records(ctx: Ctx, filters: dict[str, Any]) -> Items[AuditOut]:
    scope = authorize(ctx.caller(), ctx.action)
    for key in ("since", "until"):  # a time without a zone is read as UTC
        t = filters.get(key)
        if t is not None and t.tzinfo is None:
            filters[key] = t.replace(tzinfo=UTC)
    tenant = filters.pop("tenant", None)
    if scope.tenant is not None:
        if tenant is not None and tenant != scope.tenant:
            return Items[AuditOut](items=[])
        tenant = scope.tenant
    with ctx.db.read() as s:
        rows = audit.query(s, tenant=tenant, **filters)
        return Items[AuditOut](items=[_out(r) for r in rows])


def verify(ctx: Ctx) -> AuditVerifyOut:
    authorize(ctx.caller(), ctx.action)
    rep = check_chain(ctx.db, ctx.settings.audit_anchor_path)
    return AuditVerifyOut(ok=rep.ok, records=rep.records, first_broken=rep.first_broken, cause=rep.cause)


# --- the key and the anchor -----------------------------------------------------------------------


class AnchorUnreadable(ValueError):
    """The anchor file exists but cannot be trusted (corrupt, or signed with another key)."""


def load_or_create_key(path: Path) -> bytes:
    """The audit key (hex in a 0600 file), made on first start."""
    return keyfile.load_or_create_key(path, "audit")


class AnchorBehind(Exception):
    """The anchor file could not be advanced (e.g. the data dir is full): the chain may be intact,
    but records past the anchor are not yet protected against being cut from the end."""


def _anchor_mac(key: bytes, anchor: audit.Anchor) -> str:
    return hmac.new(key, f"audit-anchor:{anchor.seq}:{anchor.hash}".encode(), hashlib.sha256).hexdigest()


def read_anchor(path: Path, key: bytes) -> audit.Anchor | None:
    """The anchor this server wrote, None when there is none yet; AnchorUnreadable if not trusted."""
    try:
        data = json.loads(path.read_text())
        anchor = audit.Anchor(seq=int(data["seq"]), hash=str(data["hash"]))
        mac = str(data["mac"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise AnchorUnreadable(f"audit anchor {path} is unreadable ({type(e).__name__})") from None
    if not hmac.compare_digest(_anchor_mac(key, anchor), mac):
        raise AnchorUnreadable(f"audit anchor {path}: signature does not match (edited, or another key)")
    return anchor


def write_anchor(path: Path, key: bytes, anchor: audit.Anchor) -> None:
    from computepool.server.logic.bootstrap import write_secret_file

    doc = {"seq": anchor.seq, "hash": anchor.hash, "mac": _anchor_mac(key, anchor)}
    write_secret_file(path, json.dumps(doc) + "\n")


def prepare(db: Database, key_path: Path, anchor_path: Path) -> None:
    """At start: give the database the key, and seal a head never sealed before (a pool from before
    sealing, or a new key) — but only when no anchor exists, which would make that a tampering."""
    key = load_or_create_key(key_path)
    db.set_audit_key(key)
    with db.write() as s:
        seq, head_hash, mac = audit.read_head(s)
        if audit.seal_matches(key, seq, head_hash, mac) or mac is not None:
            return
        if anchor_path.exists():
            log.error("audit head at seq %d has no seal although this server anchored one before", seq)
            return
        audit.reseal(s, key)
    log.warning("sealed the audit head at seq %d with the audit key (first start with a key)", seq)


def check_chain(db: Database, anchor_path: Path) -> audit.ChainReport:
    """The whole chain against its head, the seal and this server's anchor."""
    key = db.audit_key
    anchor: audit.Anchor | None = None
    if key is not None:
        try:
            anchor = read_anchor(anchor_path, key)
        except AnchorUnreadable as e:
            return audit.ChainReport(ok=False, records=0, first_broken=None, cause=str(e))
    with db.read() as s:
        return audit.verify(s, key, anchor)


@dataclass
class Watch:
    """The last anchor written; `step` moves it forward or reports how the table fell behind it."""

    db: Database
    anchor_path: Path
    anchor: audit.Anchor | None = None
    loaded: bool = False

    def step(self) -> str | None:
        """One look at the head (two indexed reads): None when fine, else what is wrong."""
        key = self.db.audit_key
        if key is None:
            return None
        if not self.loaded:
            self.anchor = read_anchor(self.anchor_path, key)
            self.loaded = True
        with self.db.read() as s:
            seq, head_hash, mac = audit.read_head(s)
            at = audit.hash_at(s, self.anchor.seq) if self.anchor is not None and self.anchor.seq else None
        a = self.anchor
        if a is not None and seq < a.seq:
            return f"records cut from the end: the server's anchor says seq {a.seq}, head says {seq}"
        if a is not None and a.seq and at != a.hash:
            return f"tail rewritten: record {a.seq} differs from the one the server anchored"
        if not audit.seal_matches(key, seq, head_hash, mac):
            return "head signature does not match: the head was changed without the server's audit key"
        if a is None or seq > a.seq:
            ahead = audit.Anchor(seq, head_hash)
            try:
                write_anchor(self.anchor_path, key, ahead)
            except OSError as e:  # kept where it was; the next round tries again
                was = f"seq {a.seq}" if a is not None else "none yet"
                raise AnchorBehind(
                    f"audit anchor behind: it holds {was}, the head is at seq {seq} "
                    f"(cannot write {self.anchor_path}: {e.strerror or e})"
                ) from None
            self.anchor = ahead  # only once the anchor is durably on disk
        return None
