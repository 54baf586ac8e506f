"""Blobs and file requests: uploads under two caps, reads for the tenant (and for the nodes that run
its work), and the files a job wrote, packed by its node's agent and handed back as a blob.

Uploads are streamed to a temp file while hashed, so a 256 MiB archive is never held in memory;
the caps are checked on the declared length first (nothing is read), then on the bytes as they
come. Over a cap is 413 with the sizes in the message, and nothing is kept. Two uploads of one
tenant check its cap in turn (its row is locked), and the same bytes sent twice at once are one
blob. A blob no live allocation and no function names, and nobody used for a day, is forgotten by
a sweep that runs with uploads.

The bytes live in the blob dir (`--blob-dir`), the rows in the shared database: replicas must share
the dir. A blob held whose file is missing here is taken again when re-sent (HEAD says 404, so
clients re-send), and a read of it says what is wrong instead of a bare 404.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path, PurePosixPath
from typing import Any

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from computepool.core.tarsafe import is_sha256
from computepool.server import topics
from computepool.server.context import Ctx
from computepool.server.errors import ApiError, Conflict, InsufficientStorage, Invalid, NotFound
from computepool.server.hub import Hub
from computepool.server.logic.audit import record
from computepool.server.policy import Role, Target, authorize
from computepool.store import allocations as alloc_store
from computepool.store import blobs as store
from computepool.store import nodes as node_store
from computepool.store import tenants as tenant_store
from computepool.store.db import db_now
from computepool.store.models import FileRequest, Tenant
from computepool.wire.blobs import BlobOut, FileRequestCreate, FileRequestOut, PendingFile

MIB = 1 << 20
KEEP_UNUSED = timedelta(days=1)
MAX_PENDING_FILES = 16  # file requests one tenant may have waiting for agents
FILES_UNANSWERED = timedelta(minutes=10)  # a request no agent answered this long is failed
SWEEP_EVERY_S = 3600.0
_sweep_lock = threading.Lock()
_last_sweep = [0.0]


class TooLarge(ApiError):
    status = 413


class TooMany(ApiError):
    status = 429


class NotHere(NotFound):
    """The database says the blob is held, but its file is not under this replica's blob dir."""


def _dir(ctx: Ctx) -> Path:
    return ctx.settings.blobs_path


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def _check_sha(sha: str) -> None:
    if not is_sha256(sha):
        raise Invalid("sha256: expected 64 lower-case hex digits", "sha256")


def _tenant_id(ctx: Ctx) -> tuple[str, int]:
    caller = ctx.caller()
    if not caller.tenant:
        raise Invalid("this credential has no tenant to hold blobs", "tenant")
    with ctx.db.read() as s:
        t = tenant_store.get(s, caller.tenant)
        if t is None:
            raise NotFound.of("tenant", caller.tenant, "tenant")
        return t.name, t.id


def _upload_cap(ctx: Ctx) -> int:
    return int(ctx.settings.blob_max_mib) * MIB


def _tenant_cap(ctx: Ctx) -> int:
    return int(ctx.settings.tenant_blob_max_mib) * MIB


def _over_upload(ctx: Ctx, size: int | None) -> str:
    cap = _upload_cap(ctx)
    said = f"{_mib(size)}" if size is not None else f"more than {_mib(cap)}"
    return f"blob of {said} is over the per-upload cap of {_mib(cap)} (the server's --blob-max-mib)"


def _over_tenant(ctx: Ctx, tenant: str, used: int, size: int) -> str:
    return (
        f"tenant {tenant} holds {_mib(used)} of blobs; {_mib(size)} more would pass its cap of "
        f"{_mib(_tenant_cap(ctx))} (the server's --tenant-blob-max-mib)"
    )


async def _stream(ctx: Ctx, chunks: AsyncIterator[bytes]) -> tuple[store.TempBlob, str]:
    """The body into a temp file under the per-upload cap; (temp, sha256). Raises TooLarge."""
    cap = _upload_cap(ctx)
    try:
        tmp = await run_in_threadpool(store.new_temp, _dir(ctx))
    except OSError as e:
        raise _full(e) from None
    try:
        async for chunk in chunks:
            if tmp.size + len(chunk) > cap:
                raise TooLarge(_over_upload(ctx, None), "body")
            if chunk:
                await run_in_threadpool(tmp.write, chunk)
        sha = await run_in_threadpool(tmp.finish)
    except OSError as e:
        tmp.discard()  # nothing half-written stays
        raise _full(e) from None
    except BaseException:
        tmp.discard()
        raise
    return tmp, sha


def _full(e: OSError) -> Exception:
    """507 for a full disk (or quota), naming the store; any other OSError as it was."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientStorage(
            "the blob store is full (no space left in the server's --blob-dir); nothing was kept, "
            "retry later or ask an operator to free space",
            "body",
        )
    return e


# --- uploads ------------------------------------------------------------------------------------
async def put(ctx: Ctx, sha: str, declared: int | None, chunks: AsyncIterator[bytes]) -> tuple[BlobOut, bool]:
    """Store the body as blob `sha` for the caller's tenant: (answer, created)."""
    _check_sha(sha)
    tenant, tenant_id = await run_in_threadpool(_tenant_id, ctx)
    if declared is not None and declared > _upload_cap(ctx):
        raise TooLarge(_over_upload(ctx, declared), "body")
    held_size, used = await run_in_threadpool(_holding, ctx, tenant_id, sha)
    if held_size is not None and store.blob_path(_dir(ctx), sha).is_file():
        return await run_in_threadpool(_commit, ctx, tenant, tenant_id, sha, held_size, None), False
    # not held, or held but its file is not here (another replica's blob dir): take the bytes
    if held_size is None and declared is not None and used + declared > _tenant_cap(ctx):
        raise TooLarge(_over_tenant(ctx, tenant, used, declared), "body")
    tmp, got = await _stream(ctx, chunks)
    if got != sha:
        tmp.discard()
        raise ApiError(f"the body's sha256 is {got}, not {sha} as the path says", "sha256")
    try:
        out = await run_in_threadpool(_commit, ctx, tenant, tenant_id, sha, tmp.size, tmp)
    finally:
        tmp.discard()  # moved into place already, unless the commit was refused
    _maybe_sweep(ctx)
    return out, out.created


def _holding(ctx: Ctx, tenant_id: int, sha: str) -> tuple[int | None, int]:
    """(size of the blob if the tenant holds it, bytes the tenant holds)."""
    with ctx.db.read() as s:
        row = store.held(s, tenant_id, sha)
        return (row.size if row is not None else None), store.tenant_bytes(s, tenant_id)


def _commit(
    ctx: Ctx, tenant: str, tenant_id: int, sha: str, size: int, tmp: store.TempBlob | None
) -> BlobOut:
    placed = False  # whether this call put the blob's file in place (none was there)
    try:
        with ctx.db.write() as s:
            store.lock_tenant(s, tenant_id)  # uploads of one tenant check its cap one after another
            now = db_now(s)
            used = store.tenant_bytes(s, tenant_id)
            if tmp is not None and store.held(s, tenant_id, sha) is None and used + size > _tenant_cap(ctx):
                raise TooLarge(_over_tenant(ctx, tenant, used, size), "body")
            if tmp is not None:
                placed = not store.blob_path(_dir(ctx), sha).exists()
                store.keep(_dir(ctx), tmp, sha)
            created = store.hold(s, tenant_id, sha, size, now)
            if created:
                used += size
                record(s, ctx, f"blob:{sha[:16]}", tenant=tenant, detail={"size": size}, now=now)
    except BaseException:
        if placed:  # the row was not stored (a full database, say): no file without a holder stays
            _unplace(ctx, sha)
        raise
    return BlobOut(sha256=sha, size=size, created=created, tenant_bytes=used)


def _unplace(ctx: Ctx, sha: str) -> None:
    """Remove the blob's file unless some tenant holds it (another upload of the same bytes may
    have committed meanwhile); when the database cannot say, the file stays."""
    try:
        with ctx.db.read() as s:
            if store.anyone_holds(s, sha):
                return
    except SQLAlchemyError:
        return
    store.blob_path(_dir(ctx), sha).unlink(missing_ok=True)


def _maybe_sweep(ctx: Ctx) -> None:
    """At most once an hour per server process, and never two at once."""
    now = time.monotonic()
    if now - _last_sweep[0] < SWEEP_EVERY_S or not _sweep_lock.acquire(blocking=False):
        return
    try:
        _last_sweep[0] = now
        with ctx.db.write() as s:
            store.sweep(s, _dir(ctx), KEEP_UNUSED, db_now(s))
    finally:
        _sweep_lock.release()


def claim(s: Session, tenant_id: int, req: dict[str, Any], now: datetime) -> None:
    """A request's `code` and `stdin` must be blobs its tenant holds (422 naming the field); renewed."""
    for field in ("code", "stdin"):
        sha = req.get(field)
        if sha and store.held(s, tenant_id, sha) is None:
            raise Invalid(f"{field}: blob {sha} not found (upload it first: PUT /blobs/{sha})", field)
    store.touch(s, tenant_id, [req.get("code") or "", req.get("stdin") or ""], now)


# --- reads --------------------------------------------------------------------------------------
def locate(ctx: Ctx, sha: str, *, own: bool = False) -> tuple[Path, int]:
    """The blob's file and size, if the caller may read it; the same 404 otherwise.

    Users read their tenant's blobs (admins any, unless `own`: whether their tenant holds it, as
    HEAD asks before an upload); a node reads those its live allocations name (code, stdin).
    """
    _check_sha(sha)
    caller = ctx.caller()
    path = store.blob_path(_dir(ctx), sha)
    with ctx.db.read() as s:
        if caller.role is Role.NODE:
            ok = caller.node is not None and store.referenced_on(s, caller.node, sha)
        elif caller.role is Role.ADMIN and not own:
            ok = store.anyone_holds(s, sha)
        else:
            t = tenant_store.get(s, caller.tenant or "")
            ok = t is not None and store.held(s, t.id, sha) is not None
    if not ok:
        raise NotFound.of("blob", sha)
    if not path.is_file():
        raise NotHere(
            f"blob {sha} is held but its bytes are not on this replica: give replicas one --blob-dir "
            "(a directory they share), or upload the blob again through this one"
        )
    return path, path.stat().st_size


def room_headers(ctx: Ctx) -> dict[str, str]:
    """The per-upload cap and what the caller's tenant may still add (users only)."""
    caller = ctx.caller()
    out = {"X-Blob-Max-Bytes": str(_upload_cap(ctx))}
    if caller.role is not Role.NODE and caller.tenant:
        with ctx.db.read() as s:
            t = tenant_store.get(s, caller.tenant)
            if t is not None:
                used = store.tenant_bytes(s, t.id)
                out["X-Tenant-Blob-Used-Bytes"] = str(used)
                out["X-Tenant-Blob-Max-Bytes"] = str(_tenant_cap(ctx))
    return out


# --- file requests ------------------------------------------------------------------------------
def _clean_path(raw: str) -> str:
    p = PurePosixPath(raw)
    if p.is_absolute():
        raise Invalid(f"path: {raw!r} must be relative to the job's work dir", "path")
    if ".." in p.parts:
        raise Invalid(f"path: {raw!r} may not contain '..'", "path")
    return str(p)


def _file_out(r: FileRequest) -> FileRequestOut:
    return FileRequestOut(
        id=r.id,
        allocation_id=r.allocation_id,
        attempt=r.attempt,
        node=r.node,
        rank=r.rank,
        path=r.path,
        state=r.state,
        blob=r.blob_sha256,
        size=r.size,
        error=r.error,
        created_at=r.created_at,
        ended_at=r.ended_at,
    )


def request_files(ctx: Ctx, alloc_id: int, body: FileRequestCreate, hub: Hub) -> FileRequestOut:
    """Ask the node that ran (or runs) the job for `path`; its agent answers within seconds."""
    path = _clean_path(body.path)
    with ctx.db.write() as s:
        a = alloc_store.get(s, alloc_id)
        if a is None:
            raise NotFound.of("allocation", alloc_id)
        authorize(ctx.caller(), ctx.action, Target("allocation", str(alloc_id), tenant=a.tenant.name))
        if a.command is None:
            raise Conflict(f"allocation {alloc_id} runs no job: there are no files to fetch")
        nodes = list(a.nodes)
        if not nodes:
            raise Conflict(f"allocation {alloc_id} is {a.state} and has not run on any node yet")
        now = db_now(s)
        _room_for_files(s, a.tenant_id, a.tenant.name, now)
        rank = body.rank or 0
        if rank >= len(nodes):
            raise Invalid(f"rank: {rank} is past the last member (the job has {len(nodes)})", "rank")
        if node_store.get(s, nodes[rank]) is None:
            raise Conflict(
                f"node {nodes[rank]}, where the job ran, has left the pool: its files went with it"
            )
        row = FileRequest(
            allocation_id=a.id,
            tenant_id=a.tenant_id,
            attempt=a.attempt,
            node=nodes[rank],
            rank=rank,
            path=path,
            state="pending",
            error="",
            created_at=now,
        )
        s.add(row)
        s.flush()
        record(s, ctx, f"allocation:{alloc_id}", tenant=a.tenant.name, detail={"files": path}, now=now)
        out = _file_out(row)
    hub.notify(topics.node(out.node))
    return out


def _room_for_files(s: Session, tenant_id: int, tenant: str, now: datetime) -> None:
    """429 when the tenant has MAX_PENDING_FILES requests waiting (those unanswered too long fail)."""
    store.lock_tenant(s, tenant_id)
    mins = int(FILES_UNANSWERED.total_seconds() // 60)
    why = f"no answer from the node in {mins} minutes"
    store.expire_pending(s, tenant_id, now - FILES_UNANSWERED, why, now)
    waiting = store.pending_of_tenant(s, tenant_id)
    if waiting >= MAX_PENDING_FILES:
        raise TooMany(
            f"tenant {tenant} has {waiting} file requests pending, the most a tenant may have "
            f"({MAX_PENDING_FILES}): wait for them to be answered"
        )


def get_file_request(ctx: Ctx, alloc_id: int, rid: int) -> FileRequestOut:
    with ctx.db.read() as s:
        a = alloc_store.get(s, alloc_id)
        if a is None:
            raise NotFound.of("allocation", alloc_id)
        authorize(ctx.caller(), ctx.action, Target("allocation", str(alloc_id), tenant=a.tenant.name))
        r = s.get(FileRequest, rid)
        if r is None or r.allocation_id != alloc_id:
            raise NotFound.of("file request", rid)
        return _file_out(r)


def pending_for(s: Session, node: str) -> list[PendingFile]:
    """The node's unanswered file requests (for its assignments answer)."""
    rows = store.pending_files(s, node)
    names = {tid: tname for tid, tname in s.execute(select(Tenant.id, Tenant.name))} if rows else {}
    return [
        PendingFile(
            id=r.id, allocation_id=r.allocation_id, attempt=r.attempt, tenant=names[r.tenant_id], path=r.path
        )
        for r in rows
    ]


def _pending_row(ctx: Ctx, name: str, rid: int) -> tuple[str, int]:
    authorize(ctx.caller(), ctx.action, Target("node", name, node=name))
    with ctx.db.read() as s:
        r = s.get(FileRequest, rid)
        if r is None or r.node != name:
            raise NotFound.of("file request", rid)
        if r.state != "pending":
            raise Conflict(f"file request {rid} is {r.state} already")
        t = s.get(Tenant, r.tenant_id)
        return (t.name if t else ""), r.tenant_id


def _end_request(ctx: Ctx, rid: int, *, sha: str | None, size: int | None, error: str) -> FileRequestOut:
    with ctx.db.write() as s:
        r = s.get(FileRequest, rid)
        if r is None:
            raise NotFound.of("file request", rid)
        r.state = "done" if sha else "failed"
        r.blob_sha256, r.size, r.error = sha, size, error[:1024]
        r.ended_at = db_now(s)
        record(s, ctx, f"file-request:{rid}", detail={"state": r.state, "size": size}, now=r.ended_at)
        return _file_out(r)


async def answer(
    ctx: Ctx, name: str, rid: int, declared: int | None, chunks: AsyncIterator[bytes], hub: Hub
) -> FileRequestOut:
    """The agent's packed files: kept as a blob of the job's tenant, under the same caps."""
    tenant, tenant_id = await run_in_threadpool(_pending_row, ctx, name, rid)
    why = ""
    tmp: store.TempBlob | None = None
    if declared is not None and declared > _upload_cap(ctx):
        why = _over_upload(ctx, declared)
    else:
        try:
            tmp, sha = await _stream(ctx, chunks)
        except TooLarge as e:
            why = e.message
    if tmp is not None:
        try:
            await run_in_threadpool(_commit, ctx, tenant, tenant_id, sha, tmp.size, tmp)
            out = await run_in_threadpool(_end_request, ctx, rid, sha=sha, size=tmp.size, error="")
        except TooLarge as e:
            why = e.message
        finally:
            tmp.discard()
    if why:
        out = await run_in_threadpool(_end_request, ctx, rid, sha=None, size=None, error=why)
    hub.notify(topics.files(rid))
    return out


def fail(ctx: Ctx, name: str, rid: int, error: str, hub: Hub) -> FileRequestOut:
    _pending_row(ctx, name, rid)
    out = _end_request(ctx, rid, sha=None, size=None, error=error)
    hub.notify(topics.files(rid))
    return out
