"""Blobs: bytes on disk under the server's data dir, and the rows saying which tenant holds which.

Files live at `DATA_DIR/blobs/sha256/<2 hex>/<62 hex>`, written to a temp file in the same tree
and renamed into place, so a reader never sees half a blob. The same bytes held by several
tenants are stored once and counted against each tenant's cap. File requests (a job's files, to
be packed by the node's agent) are here too: they end as a blob of the tenant.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from computepool.core.allocation import LIVE
from computepool.store.models import Allocation, Blob, FileRequest

CHUNK = 1 << 20


def blob_root(data_dir: Path) -> Path:
    return data_dir / "blobs" / "sha256"


def blob_path(data_dir: Path, sha: str) -> Path:
    return blob_root(data_dir) / sha[:2] / sha[2:]


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


def new_temp(data_dir: Path) -> TempBlob:
    tmp_dir = data_dir / "blobs" / "tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, name = tempfile.mkstemp(dir=tmp_dir, prefix="upload-")
    os.close(fd)
    return TempBlob(Path(name))


def keep(data_dir: Path, tmp: TempBlob, sha: str) -> None:
    """Move a finished upload into place (or drop it when the same bytes are there already)."""
    dest = blob_path(data_dir, sha)
    if dest.exists():
        tmp.discard()
        return
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(tmp.path, 0o600)
    os.replace(tmp.path, dest)


def write_bytes(data_dir: Path, data: bytes) -> str:
    """A whole blob at once (small ones: packed job files)."""
    tmp = new_temp(data_dir)
    try:
        tmp.write(data)
        sha = tmp.finish()
    except BaseException:
        tmp.discard()
        raise
    keep(data_dir, tmp, sha)
    return sha


# --- rows ---------------------------------------------------------------------------------------
def held(s: Session, tenant_id: int, sha: str) -> Blob | None:
    return s.get(Blob, (tenant_id, sha))


def tenant_bytes(s: Session, tenant_id: int) -> int:
    return int(
        s.scalar(select(func.coalesce(func.sum(Blob.size), 0)).where(Blob.tenant_id == tenant_id)) or 0
    )


def hold(s: Session, tenant_id: int, sha: str, size: int, now: datetime) -> bool:
    """Record that the tenant holds the blob; False when it did already (its use time is renewed)."""
    row = held(s, tenant_id, sha)
    if row is not None:
        row.last_used_at = now
        return False
    s.add(Blob(tenant_id=tenant_id, sha256=sha, size=size, created_at=now, last_used_at=now))
    return True


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


def sweep(s: Session, data_dir: Path, older_than: timedelta, now: datetime) -> int:
    """Forget blobs unused for `older_than` that no live allocation names; remove files nobody holds."""
    live = {
        v
        for (req,) in s.execute(select(Allocation.request).where(Allocation.state.in_(LIVE)))
        for v in (req.get("code"), req.get("stdin"))
        if v
    }
    old = s.execute(select(Blob.tenant_id, Blob.sha256).where(Blob.last_used_at < now - older_than)).all()
    dropped = [(t, sha) for t, sha in old if sha not in live]
    for t, sha in dropped:
        s.execute(delete(Blob).where(Blob.tenant_id == t, Blob.sha256 == sha))
    s.flush()
    for sha in {sha for _, sha in dropped}:
        if not anyone_holds(s, sha):
            blob_path(data_dir, sha).unlink(missing_ok=True)
    return len(dropped)


# --- file requests ------------------------------------------------------------------------------
def pending_files(s: Session, node: str) -> Sequence[FileRequest]:
    stmt = select(FileRequest).where(FileRequest.node == node, FileRequest.state == "pending")
    return s.scalars(stmt.order_by(FileRequest.id)).all()
