"""Remote functions, their worker allocations and their calls: the SQL behind services/functions.

The hot paths (submit, claim, finish, results) are plain Core statements built once, one short
statement each: a warm call costs a handful of indexed statements in all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, bindparam, exists, func, select
from sqlalchemy.orm import Session

from computepool.core.allocation import HOLDING, LIVE
from computepool.core.states import CallState
from computepool.store.models import Allocation, Function, FunctionCall, FunctionWorker, Node, Tenant

_F = Function.__table__
_W = FunctionWorker.__table__
_C = FunctionCall.__table__
_A = Allocation.__table__
_T = Tenant.__table__
MAX_OUTPUT_CHARS = 8 << 20  # what one call may print; more is dropped (the caller is told so once)
ENDED_CALL = ("done", "failed", "cancelled")
PYTHON_LABEL = "cpool.io/python-{}"


# --- functions ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FunctionRow:
    id: int
    tenant: str
    tenant_id: int
    owner: str
    name: str
    request: dict[str, Any]
    python: str
    keep_warm_s: int
    max_workers: int
    failures: int
    last_failure: str
    deleted: bool


_FN_COLS = (
    _F.c.id,
    _T.c.name,
    _F.c.tenant_id,
    _F.c.owner,
    _F.c.name,
    _F.c.request,
    _F.c.python,
    _F.c.keep_warm_s,
    _F.c.max_workers,
    _F.c.failures,
    _F.c.last_failure,
    _F.c.deleted_at.is_not(None),
)
_FN = select(*_FN_COLS).join(_T, _T.c.id == _F.c.tenant_id)
_FN_BY_ID = _FN.where(_F.c.id == bindparam("fid"))
_FN_BY_ID_LOCKED = _FN_BY_ID.with_for_update(of=_F)


def _fn(row: Any) -> FunctionRow:
    return FunctionRow(*row)


def get_function(s: Session, fid: int, *, lock: bool = False) -> FunctionRow | None:
    row = s.connection().execute(_FN_BY_ID_LOCKED if lock else _FN_BY_ID, {"fid": fid}).one_or_none()
    return None if row is None else _fn(row)


def by_spec(s: Session, tenant_id: int, spec_hash: str) -> FunctionRow | None:
    stmt = _FN.where(_F.c.tenant_id == tenant_id, _F.c.spec_hash == spec_hash).with_for_update(of=_F)
    row = s.connection().execute(stmt).one_or_none()
    return None if row is None else _fn(row)


def insert_function(s: Session, values: dict[str, Any]) -> int:
    row = dict(values, failures=0, last_failure="", deleted_at=None)
    return int(s.connection().execute(_F.insert().returning(_F.c.id), row).scalar_one())


def revive(s: Session, fid: int) -> None:
    """A deleted function registered again with the same spec: the same id, a fresh start."""
    s.connection().execute(
        _F.update().where(_F.c.id == fid).values(deleted_at=None, failures=0, last_failure="")
    )


def mark_deleted(s: Session, fid: int, now: datetime) -> None:
    s.connection().execute(_F.update().where(_F.c.id == fid).values(deleted_at=now))


def list_functions(s: Session, tenant: str | None) -> list[FunctionRow]:
    stmt = _FN.where(_F.c.deleted_at.is_(None)).order_by(_F.c.id)
    if tenant is not None:
        stmt = stmt.where(_T.c.name == tenant)
    return [_fn(r) for r in s.connection().execute(stmt)]


def counts(s: Session, fids: Sequence[int]) -> dict[int, tuple[int, int]]:
    """(workers live, calls pending) per function, in two grouped queries."""
    out = {f: (0, 0) for f in fids}
    if not fids:
        return out
    conn = s.connection()
    live: dict[int, int] = dict(
        conn.execute(
            select(_W.c.function_id, func.count())
            .join(_A, _A.c.id == _W.c.allocation_id)
            .where(_W.c.function_id.in_(fids), _W.c.ended.is_(False), _A.c.state.in_(LIVE))
            .group_by(_W.c.function_id)
        ).all()
    )
    pending: dict[int, int] = dict(
        conn.execute(
            select(_C.c.function_id, func.count())
            .where(_C.c.function_id.in_(fids), _C.c.state == "pending")
            .group_by(_C.c.function_id)
        ).all()
    )
    return {f: (int(live.get(f, 0)), int(pending.get(f, 0))) for f in fids}


def python_labels(pythons: Sequence[str]) -> dict[str, str]:
    """The labels a node carries for the Python versions its agent reported (`cpool.io/python-3.11`
    = `yes`): function workers select them, so they land only where their Python runs."""
    return {PYTHON_LABEL.format(v): "yes" for v in pythons}


def set_pythons(s: Session, node: str, pythons: Sequence[str]) -> None:
    """Store what the node provides, and its labels to match (other labels are left as they are)."""
    s.flush()  # changes made to ORM objects so far are written, not lost to the expiry below
    n = Node.__table__
    labels = s.connection().execute(select(n.c.labels).where(n.c.name == node)).scalar_one_or_none()
    if labels is None:
        return
    prefix = PYTHON_LABEL.format("")
    kept = {k: v for k, v in labels.items() if not k.startswith(prefix)}
    s.connection().execute(
        n.update()
        .where(n.c.name == node)
        .values(pythons=sorted(set(pythons)), labels=kept | python_labels(sorted(set(pythons))))
    )
    s.expire_all()  # ORM objects of the node read before see the change


def pythons_of_ready_nodes(s: Session, since: datetime) -> set[str]:
    """Python versions of nodes that sent a heartbeat after `since` (ready ones)."""
    rows = s.connection().execute(
        select(Node.__table__.c.pythons).where(Node.__table__.c.last_heartbeat_at >= since)
    )
    return {v for (vs,) in rows for v in (vs or [])}


# --- workers ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerAuth:
    allocation_id: int
    function_id: int
    secret_hash: str
    state: str
    tenant: str


_BY_TOKEN = (
    select(_W.c.allocation_id, _W.c.function_id, _W.c.secret_hash, _A.c.state, _T.c.name)
    .join(_A, _A.c.id == _W.c.allocation_id)
    .join(_T, _T.c.id == _A.c.tenant_id)
    .where(_W.c.token_id == bindparam("token_id"))
)


def worker_by_token(s: Session, token_id: str) -> WorkerAuth | None:
    row = s.connection().execute(_BY_TOKEN, {"token_id": token_id}).one_or_none()
    return None if row is None else WorkerAuth(*row)


def add_worker(s: Session, alloc_id: int, fid: int, token_id: str, secret_hash: str, now: datetime) -> None:
    s.connection().execute(
        _W.insert(),
        {
            "allocation_id": alloc_id,
            "function_id": fid,
            "token_id": token_id,
            "secret_hash": secret_hash,
            "ended": False,
            "created_at": now,
        },
    )


@dataclass(frozen=True)
class WorkerHead:
    """What a worker's call needs to know, in one query: its allocation's state and its function's."""

    state: str
    deleted: bool
    keep_warm_s: int
    max_workers: int = 1


_WORKER_HEAD = (
    select(_A.c.state, _F.c.deleted_at.is_not(None), _F.c.keep_warm_s, _F.c.max_workers)
    .select_from(_W.join(_A, _A.c.id == _W.c.allocation_id).join(_F, _F.c.id == _W.c.function_id))
    .where(_W.c.allocation_id == bindparam("alloc_id"))
)


def worker_head(s: Session, alloc_id: int) -> WorkerHead | None:
    row = s.connection().execute(_WORKER_HEAD, {"alloc_id": alloc_id}).one_or_none()
    return None if row is None else WorkerHead(row[0], bool(row[1]), int(row[2]), int(row[3]))


def worker_load(s: Session, fid: int) -> tuple[int, int]:
    """(live workers, idle ones): live = its allocation pending/bound/active; idle = no running call."""
    busy = exists().where(_C.c.worker_allocation_id == _W.c.allocation_id, _C.c.state == "running")
    rows = (
        s.connection()
        .execute(
            select(busy.label("busy"))
            .select_from(_W.join(_A, _A.c.id == _W.c.allocation_id))
            .where(_W.c.function_id == fid, _W.c.ended.is_(False), _A.c.state.in_(LIVE))
        )
        .all()
    )
    return len(rows), sum(1 for (b,) in rows if not b)


def live_worker_ids(s: Session, fid: int) -> list[int]:
    stmt = (
        select(_W.c.allocation_id)
        .join(_A, _A.c.id == _W.c.allocation_id)
        .where(_W.c.function_id == fid, _W.c.ended.is_(False), _A.c.state.in_(LIVE))
    )
    return [int(i) for (i,) in s.connection().execute(stmt)]


@dataclass(frozen=True)
class EndedWorker:
    allocation_id: int
    function_id: int
    state: str
    reason: str
    claimed: bool


def ended_workers(s: Session) -> list[EndedWorker]:
    """Workers not yet settled whose allocation ended (or went back to pending: a lost attempt)."""
    claimed = exists().where(_C.c.worker_allocation_id == _W.c.allocation_id)
    stmt = (
        select(_W.c.allocation_id, _W.c.function_id, _A.c.state, _A.c.reason, claimed)
        .join(_A, _A.c.id == _W.c.allocation_id)
        .where(_W.c.ended.is_(False), _A.c.state.not_in(HOLDING), _A.c.state != "pending")
        .order_by(_W.c.allocation_id)
    )
    requeued = (
        select(_W.c.allocation_id, _W.c.function_id, _A.c.state, _A.c.reason, claimed)
        .join(_A, _A.c.id == _W.c.allocation_id)
        .where(_W.c.ended.is_(False), _A.c.state == "pending", _A.c.attempt > 1)
    )
    conn = s.connection()
    return [EndedWorker(*r) for stmt_ in (stmt, requeued) for r in conn.execute(stmt_)]


def settle_worker(s: Session, alloc_id: int) -> bool:
    """Mark a worker ended; False when another replica did it first."""
    res = s.connection().execute(
        _W.update().where(_W.c.allocation_id == alloc_id, _W.c.ended.is_(False)).values(ended=True)
    )
    return bool(res.rowcount)


def set_failures(s: Session, fid: int, failures: int, last: str) -> None:
    s.connection().execute(
        _F.update().where(_F.c.id == fid).values(failures=failures, last_failure=last[:1024])
    )


def idle_pending_workers(s: Session) -> dict[int, list[int]]:
    """Function → its worker allocations still pending (never bound), for functions with no call
    waiting: workers nobody needs any more."""
    waiting = exists().where(_C.c.function_id == _W.c.function_id, _C.c.state == "pending")
    stmt = (
        select(_W.c.function_id, _W.c.allocation_id)
        .join(_A, _A.c.id == _W.c.allocation_id)
        .where(_W.c.ended.is_(False), _A.c.state == "pending", _A.c.attempt <= 1, ~waiting)
        .order_by(_W.c.allocation_id)
    )
    out: dict[int, list[int]] = {}
    for fid, aid in s.connection().execute(stmt):
        out.setdefault(int(fid), []).append(int(aid))
    return out


def functions_waiting(s: Session) -> list[int]:
    """Functions (not deleted) with calls waiting for a worker."""
    stmt = (
        select(_C.c.function_id)
        .join(_F, _F.c.id == _C.c.function_id)
        .where(_C.c.state == "pending", _F.c.deleted_at.is_(None))
        .distinct()
    )
    return [int(i) for (i,) in s.connection().execute(stmt)]


# --- calls --------------------------------------------------------------------------------------
_INSERT_CALL = _C.insert().returning(_C.c.id, sort_by_parameter_order=True)


def insert_calls(
    s: Session, fid: int, tenant_id: int, args: Sequence[str], now: datetime, key: str | None = None
) -> list[int]:
    rows = [
        {
            "function_id": fid,
            "tenant_id": tenant_id,
            "state": "pending",
            "args": a,
            "output": "",
            "stderr": "",
            "created_at": now,
            "submit_key": key,
        }
        for a in args
    ]
    return [int(i) for (i,) in s.connection().execute(_INSERT_CALL, rows)]


# statements of every call's path are built once (building and keying one costs more than running it)
_BY_KEY = (
    select(_C.c.id)
    .where(_C.c.function_id == bindparam("fid"), _C.c.submit_key == bindparam("key"))
    .order_by(_C.c.id)
)
_PENDING = select(func.count()).where(_C.c.function_id == bindparam("fid"), _C.c.state == "pending")


def calls_of_submission(s: Session, fid: int, key: str) -> list[int]:
    """The calls a submission with this key stored, in their order (none: not seen, or forgotten)."""
    return [int(i) for (i,) in s.connection().execute(_BY_KEY, {"fid": fid, "key": key})]


def pending_count(s: Session, fid: int) -> int:
    return int(s.connection().execute(_PENDING, {"fid": fid}).scalar_one())


_NEXT = (
    select(_C.c.id, _C.c.args)
    .where(_C.c.function_id == bindparam("fid"), _C.c.state == "pending")
    .order_by(_C.c.id)
    .limit(1)
    .with_for_update(skip_locked=True)
)
_CLAIM = (
    _C.update()
    .where(_C.c.id == bindparam("cid"), _C.c.state == "pending")
    .values(state="running", worker_allocation_id=bindparam("worker"), claimed_at=bindparam("now"))
)


def claim_next(s: Session, fid: int, worker: int, now: datetime) -> tuple[int, str] | None:
    """The oldest pending call of the function, now running on `worker` (SKIP LOCKED on PostgreSQL)."""
    conn = s.connection()
    for _ in range(10):  # a row another transaction took between the two statements: the next one
        row = conn.execute(_NEXT, {"fid": fid}).one_or_none()
        if row is None:
            return None
        if conn.execute(_CLAIM, {"cid": row[0], "worker": worker, "now": now}).rowcount:
            return int(row[0]), str(row[1])
    return None


_NEXT_MANY = (
    select(_C.c.id)
    .where(_C.c.function_id == bindparam("fid"), _C.c.state == "pending")
    .order_by(_C.c.id)
    .limit(bindparam("k"))
    .with_for_update(skip_locked=True)
)


_CLAIM_MANY = (
    _C.update()
    .where(_C.c.id.in_(bindparam("ids", expanding=True)), _C.c.state == "pending")
    .values(state="running", worker_allocation_id=bindparam("worker"), claimed_at=bindparam("now"))
    .returning(_C.c.id, _C.c.args)
)


def claim_many(s: Session, fid: int, worker: int, k: int, now: datetime) -> list[tuple[int, str]]:
    """Up to `k` of the oldest pending calls of the function, now running on `worker`, in id order:
    one select and one update however many (rows another transaction took meanwhile are skipped)."""
    if k <= 1:
        one = claim_next(s, fid, worker, now) if k == 1 else None
        return [] if one is None else [one]
    conn = s.connection()
    ids = [int(i) for (i,) in conn.execute(_NEXT_MANY, {"fid": fid, "k": k})]
    if not ids:
        return []
    taken = conn.execute(_CLAIM_MANY, {"ids": ids, "worker": worker, "now": now}).all()
    return sorted((int(i), str(a)) for i, a in taken)


_CALL_OF_WORKER = select(_C.c.state, _C.c.worker_allocation_id, _C.c.function_id).where(
    _C.c.id == bindparam("cid")
)
_FINISH = (
    _C.update()
    .where(_C.c.id == bindparam("cid"), _C.c.state == "running", _C.c.worker_allocation_id == bindparam("w"))
    .values(
        state=bindparam("state"),
        ok=bindparam("ok"),
        result=bindparam("result"),
        traceback=bindparam("tb"),
        ended_at=bindparam("now"),
        args="",  # no longer needed: a call runs once
    )
)


def call_of(s: Session, cid: int) -> tuple[str, int | None, int] | None:
    """(state, worker allocation, function) of a call."""
    row = s.connection().execute(_CALL_OF_WORKER, {"cid": cid}).one_or_none()
    return None if row is None else (row[0], row[1], row[2])


def _text(data: str) -> str:
    """PostgreSQL text holds no NUL: a program may print one; it is kept as U+FFFD (one character,
    so the character offsets the callers read by stay right)."""
    return data.replace("\x00", "\ufffd")


def finish(
    s: Session, cid: int, worker: int, ok: bool, result: str | None, tb: str | None, now: datetime
) -> bool:
    tb = None if tb is None else _text(tb)
    res = s.connection().execute(
        _FINISH,
        {
            "cid": cid,
            "w": worker,
            "state": "done" if ok else "failed",
            "ok": ok,
            "result": result,
            "tb": tb,
            "now": now,
        },
    )
    return bool(res.rowcount)


def finish_many(
    s: Session, worker: int, results: Sequence[tuple[int, bool, str | None, str | None]], now: datetime
) -> int:
    """Record (id, ok, result, traceback) of calls running on `worker`, in one executemany; how
    many were (a call not running on it is left as it is)."""
    params = [
        {
            "cid": cid,
            "w": worker,
            "state": "done" if ok else "failed",
            "ok": ok,
            "result": result,
            "tb": None if tb is None else _text(tb),
            "now": now,
        }
        for cid, ok, result, tb in results
    ]
    if len(params) == 1:
        return int(s.connection().execute(_FINISH, params[0]).rowcount)
    return int(s.connection().execute(_FINISH, params).rowcount)


def finished_by(s: Session, cid: int, worker: int) -> bool:
    """The call ended with this worker's result (what a hand-in sent again finds)."""
    found = call_of(s, cid)
    return found is not None and found[1] == worker and found[0] in ENDED_CALL


_APPEND = {
    stream: _C.update()
    .where(
        _C.c.id == bindparam("cid"),
        _C.c.state == "running",
        _C.c.worker_allocation_id == bindparam("w"),
        func.length(column) < MAX_OUTPUT_CHARS,
    )
    .values({column: column + bindparam("data")})
    for stream, column in (("stdout", _C.c.output), ("stderr", _C.c.stderr))
}


def append_output(s: Session, cid: int, worker: int, data: str, stream: str = "stdout") -> bool:
    """Append to the call's stdout or stderr (each capped on its own)."""
    params = {"cid": cid, "w": worker, "data": _text(data)}
    return bool(s.connection().execute(_APPEND[stream], params).rowcount)


def held_by(s: Session, worker: int, among: Sequence[int] | None = None) -> list[int]:
    """The calls running on `worker` (claimed, not handed back), or those of them among `among`."""
    stmt = select(_C.c.id).where(_C.c.worker_allocation_id == worker, _C.c.state == "running")
    if among is not None:
        stmt = stmt.where(_C.c.id.in_(list(among)))
    return [int(i) for (i,) in s.connection().execute(stmt.order_by(_C.c.id))]


def fail_calls_of_worker(s: Session, worker: int, error: str, now: datetime) -> list[int]:
    """Fail the running calls a worker claimed (it ended); their ids."""
    conn = s.connection()
    ids = [
        int(i)
        for (i,) in conn.execute(
            select(_C.c.id).where(_C.c.worker_allocation_id == worker, _C.c.state == "running")
        )
    ]
    if ids:
        conn.execute(
            _C.update()
            .where(_C.c.id.in_(ids), _C.c.state == "running")
            .values(state="failed", ok=None, error=error[:1024], ended_at=now, args="")
        )
    return ids


def fail_pending(s: Session, fid: int, error: str, now: datetime, *, state: str = "failed") -> int:
    res = s.connection().execute(
        _C.update()
        .where(_C.c.function_id == fid, _C.c.state == "pending")
        .values(state=state, error=error[:1024], ended_at=now, args="")
    )
    return int(res.rowcount)


def cancel_call(s: Session, cid: int, now: datetime, why: str) -> bool:
    res = s.connection().execute(
        _C.update()
        .where(_C.c.id == cid, _C.c.state.in_(("pending", "running")))
        .values(state="cancelled", error=why[:1024], ended_at=now, args="")
    )
    return bool(res.rowcount)


def cancel_running(s: Session, fid: int, why: str, now: datetime) -> int:
    res = s.connection().execute(
        _C.update()
        .where(_C.c.function_id == fid, _C.c.state == "running")
        .values(state="cancelled", error=why[:1024], ended_at=now, args="")
    )
    return int(res.rowcount)


@dataclass(frozen=True)
class CallRow:
    id: int
    state: CallState
    ok: bool | None
    result: str | None
    traceback: str | None
    error: str | None
    output: str
    stderr: str


_CALL_COLS = (
    _C.c.id, _C.c.state, _C.c.ok, _C.c.result, _C.c.traceback, _C.c.error, _C.c.output, _C.c.stderr
)  # fmt: skip


_ROWS = select(*_CALL_COLS).where(
    _C.c.function_id == bindparam("fid"), _C.c.id.in_(bindparam("ids", expanding=True))
)


def results(
    s: Session,
    fid: int,
    ids: Sequence[int],
    *,
    with_news: bool = False,
    budget: int | None = None,
    read: Mapping[int, tuple[int, int]] | None = None,
) -> list[CallRow]:
    """The calls of `fid` among `ids` (ids of other functions are simply absent); with `with_news`,
    only those that ended or printed something: a poll over many waiting calls reads few rows.

    With a `budget` (characters), the lowest ids whose results, tracebacks and output not yet read
    (`read`: id → stdout and stderr characters the caller has) fit in it, at least one: a thousand
    64 MiB results are never read at once; the caller asks again for the rest.
    """
    if not with_news and budget is None:
        return [CallRow(*r) for r in s.connection().execute(_ROWS, {"fid": fid, "ids": list(ids)})]
    cond = and_(_C.c.function_id == fid, _C.c.id.in_(list(ids)))
    if with_news:
        printed = (func.length(_C.c.output) > 0) | (func.length(_C.c.stderr) > 0)
        cond = and_(cond, _C.c.state.in_(ENDED_CALL) | printed)
    conn = s.connection()
    if budget is not None:
        sizes = select(
            _C.c.id,
            _C.c.state,
            func.coalesce(func.length(_C.c.result), 0) + func.coalesce(func.length(_C.c.traceback), 0),
            func.length(_C.c.output),
            func.length(_C.c.stderr),
        ).where(cond)
        chosen: list[int] = []
        total = 0
        for cid, state, outcome, out_n, err_n in conn.execute(sizes.order_by(_C.c.id)):
            have_out, have_err = (read or {}).get(int(cid), (0, 0))
            unread = max(0, int(out_n) - have_out) + max(0, int(err_n) - have_err)
            if state not in ENDED_CALL and unread == 0:
                continue  # nothing new to send: it costs the answer nothing
            n = int(outcome) + unread
            if chosen and total + n > budget:
                break
            chosen.append(int(cid))
            total += n
        if not chosen:
            return []
        cond = _C.c.id.in_(chosen)
    return [CallRow(*r) for r in conn.execute(select(*_CALL_COLS).where(cond))]


def known(s: Session, fid: int, ids: Sequence[int]) -> set[int]:
    """Which of `ids` are calls of `fid`."""
    stmt = select(_C.c.id).where(_C.c.function_id == fid, _C.c.id.in_(list(ids)))
    return {int(i) for (i,) in s.connection().execute(stmt)}


def count_known(s: Session, fid: int, ids: Sequence[int]) -> int:
    stmt = select(func.count()).where(_C.c.function_id == fid, _C.c.id.in_(list(ids)))
    return int(s.connection().execute(stmt).scalar_one())


def forget_ended(s: Session, before: datetime, limit: int = 5000) -> int:
    """Delete up to `limit` calls that ended before `before` (their results were there to fetch)."""
    conn = s.connection()
    ids = [
        int(i)
        for (i,) in conn.execute(
            select(_C.c.id).where(_C.c.state.in_(ENDED_CALL), _C.c.ended_at < before).limit(limit)
        )
    ]
    if ids:
        conn.execute(_C.delete().where(_C.c.id.in_(ids)))
    return len(ids)
