"""Blobs: bytes on disk under the blob dir, and the rows saying which tenant holds which.

Files live at `BLOB_DIR/sha256/<2 hex>/<62 hex>` (BLOB_DIR defaults to DATA_DIR/blobs), written
to a temp file in the same tree and renamed into place, so a reader never sees half a blob. The
rows are in the database every replica shares; the bytes are only where the blob dir is, which
is why replicas must share one. The same bytes held by several tenants are stored once and
counted against each tenant's cap. File requests (a job's files, to be packed by the node's
agent) are here too: they end as a blob of the tenant.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import NamedTuple

from sqlalchemy import bindparam, delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from computepool.core.allocation import LIVE
from computepool.store.models import Allocation, Blob, FileRequest, Function, Tenant

CHUNK = 1 << 20


def blob_root(blob_dir: Path) -> Path:
    return blob_dir / "sha256"


def blob_path(blob_dir: Path, sha: str) -> Path:
    return blob_root(blob_dir) / sha[:2] / sha[2:]


@dataclass
class TempBlob:
    """An upload being written: its temp file, hash and size so far."""

    path: Path
    size: int = 0

    def __post_init__(self) -> None:
        self._hash = hashlib.sha256()
        self._file = self.path.open("wb")

    def write(self, data: bytes) -> None:
        self._file.write(data)
        self._hash.update(data)
        self.size += len(data)

    def finish(self) -> str:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self._hash.hexdigest()

    def discard(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)


def new_temp(blob_dir: Path) -> TempBlob:
    tmp_dir = blob_dir / "tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, name = tempfile.mkstemp(dir=tmp_dir, prefix="upload-")
    os.close(fd)
    return TempBlob(Path(name))


def keep(blob_dir: Path, tmp: TempBlob, sha: str) -> None:
    """Move a finished upload into place (or drop it when the same bytes are there already)."""
    dest = blob_path(blob_dir, sha)
    if dest.exists():
        tmp.discard()
        return
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(tmp.path, 0o600)
    os.replace(tmp.path, dest)


def write_bytes(blob_dir: Path, data: bytes) -> str:
    """A whole blob at once (small ones: packed job files)."""
    tmp = new_temp(blob_dir)
    try:
        tmp.write(data)
        sha = tmp.finish()
    except BaseException:
        tmp.discard()
        raise
    keep(blob_dir, tmp, sha)
    return sha


# --- rows ---------------------------------------------------------------------------------------
def held(s: Session, tenant_id: int, sha: str) -> Blob | None:
    return s.get(Blob, (tenant_id, sha))


def tenant_bytes(s: Session, tenant_id: int) -> int:
    return int(
        s.scalar(select(func.coalesce(func.sum(Blob.size), 0)).where(Blob.tenant_id == tenant_id)) or 0
    )


def lock_tenant(s: Session, tenant_id: int) -> None:
    """Hold the tenant's row until the transaction ends, so that two uploads check its cap in turn
    (PostgreSQL; SQLite writers are one at a time already). `FOR NO KEY UPDATE`: inserts that
    merely reference the tenant (allocations, calls) are not held up."""
    s.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update(key_share=True))


def hold(s: Session, tenant_id: int, sha: str, size: int, now: datetime) -> bool:
    """Record that the tenant holds the blob; False when it did already (its use time is renewed).

    An insert that finds the row there (another upload of the same bytes won) counts as held."""
    dialect = postgresql if s.get_bind().dialect.name == "postgresql" else sqlite
    values = {"tenant_id": tenant_id, "sha256": sha, "size": size, "created_at": now, "last_used_at": now}
    table = Blob.__table__
    stmt = dialect.insert(table).values(**values).on_conflict_do_nothing().returning(table.c.sha256)
    if s.connection().execute(stmt).first() is not None:
        return True
    touch(s, tenant_id, [sha], now)
    return False


def touch(s: Session, tenant_id: int, shas: Iterable[str], now: datetime) -> None:
    wanted = [x for x in shas if x]
    if wanted:
        s.execute(
            update(Blob)
            .where(Blob.tenant_id == tenant_id, Blob.sha256.in_(wanted))
            .values(last_used_at=now)
            .execution_options(synchronize_session=False)
        )


def anyone_holds(s: Session, sha: str) -> bool:
    return s.scalar(select(Blob.sha256).where(Blob.sha256 == sha).limit(1)) is not None


def referenced_on(s: Session, node: str, sha: str) -> bool:
    """Whether a live allocation with a part on `node` names the blob as its code or stdin."""
    rows = s.execute(select(Allocation.request, Allocation.nodes).where(Allocation.state.in_(LIVE))).all()
    return any(node in (nodes or []) and sha in (req.get("code"), req.get("stdin")) for req, nodes in rows)


def in_use(s: Session) -> set[str]:
    """Blobs named by a live allocation or by a function not deleted (its workers start later)."""
    requests = [
        *s.execute(select(Allocation.request).where(Allocation.state.in_(LIVE))).scalars(),
        *s.execute(select(Function.request).where(Function.deleted_at.is_(None))).scalars(),
    ]
    return {v for req in requests for v in (req.get("code"), req.get("stdin")) if v}


def sweep(s: Session, blob_dir: Path, older_than: timedelta, now: datetime) -> int:
    """Forget blobs unused for `older_than` that nothing in use names; remove files nobody holds."""
    live = in_use(s)
    old = s.execute(select(Blob.tenant_id, Blob.sha256).where(Blob.last_used_at < now - older_than)).all()
    dropped = [(t, sha) for t, sha in old if sha not in live]
    for t, sha in dropped:
        s.execute(delete(Blob).where(Blob.tenant_id == t, Blob.sha256 == sha))
    s.flush()
    for sha in {sha for _, sha in dropped}:
        if not anyone_holds(s, sha):
            blob_path(blob_dir, sha).unlink(missing_ok=True)
    return len(dropped)


# --- file requests ------------------------------------------------------------------------------
_FILE_T = FileRequest.__table__
_PENDING_FILES = (
    select(_FILE_T.c.id, _FILE_T.c.allocation_id, _FILE_T.c.attempt, _FILE_T.c.tenant_id, _FILE_T.c.path)
    .where(_FILE_T.c.node == bindparam("node"), _FILE_T.c.state == "pending")
    .order_by(_FILE_T.c.id)
)


class PendingFileRow(NamedTuple):
    id: int
    allocation_id: int
    attempt: int
    tenant_id: int
    path: str


def pending_files(s: Session, node: str) -> list[PendingFileRow]:
    """A node's unanswered file requests, oldest first; plain rows: every assignments read asks,
    and almost always finds none."""
    return [PendingFileRow(*r) for r in s.connection().execute(_PENDING_FILES, {"node": node})]


def pending_of_tenant(s: Session, tenant_id: int) -> int:
    stmt = select(func.count()).where(FileRequest.tenant_id == tenant_id, FileRequest.state == "pending")
    return int(s.scalar(stmt) or 0)


def expire_pending(s: Session, tenant_id: int, before: datetime, error: str, now: datetime) -> int:
    """Fail the tenant's file requests asked before `before` that no agent answered."""
    fr = FileRequest.__table__
    res = s.connection().execute(
        fr.update()
        .where(fr.c.tenant_id == tenant_id, fr.c.state == "pending", fr.c.created_at < before)
        .values(state="failed", error=error[:1024], ended_at=now)
    )
    return int(res.rowcount or 0)
