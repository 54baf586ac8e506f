"""First start: an admin user and token, written to DATA_DIR/admin-token (mode 0600).

The token file is written before the transaction commits: if the commit fails, the next start
finds no users and writes a fresh token, so a committed admin never lacks its token file.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from sqlalchemy import select

from computepool.server.credentials import new_secret
from computepool.store import audit, tenants, tokens, users
from computepool.store.db import Database, db_now
from computepool.store.models import ApiToken, AuditHead

log = logging.getLogger("computepool.server")

DEFAULT_TENANT = "default"
ADMIN_USER = "admin"


def write_secret_file(path: Path, text: str) -> None:
    """Create or replace `path` with mode 0600 from the first byte (never world-readable),
    durably: once this returns the new content survives a crash; when it raises the old is kept."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        data = memoryview(text.encode())
        while data:
            data = data[os.write(fd, data) :]
        os.fsync(fd)
    except OSError:
        os.close(fd)
        tmp.unlink(missing_ok=True)  # a full disk leaves the old file whole and no half-written one
        raise
    os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:  # the rename itself durable: after a crash the new file is there, not the old one
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def ensure_admin(db: Database, token_path: Path) -> bool:
    """Create the first admin if the pool has no users; True when it did."""
    with db.write() as s:
        # Lock the audit head first: replicas starting together bootstrap one at a time.
        s.execute(select(AuditHead).where(AuditHead.id == 1).with_for_update()).scalar_one()
        if users.count(s) > 0:
            return False
        now = db_now(s)
        tenant = tenants.get(s, DEFAULT_TENANT) or tenants.create(s, DEFAULT_TENANT, 1.0, now)
        admin = users.create(s, ADMIN_USER, tenant, "admin", now)
        secret = new_secret()
        tokens.add(
            s,
            ApiToken(
                id=secret.id,
                secret_hash=secret.secret_hash,
                name="bootstrap",
                user_id=admin.id,
                created_by="system",
                created_at=now,
            ),
        )
        audit.append(
            s,
            audit.AuditEvent(
                actor="system",
                action="bootstrap",
                target=f"user:{ADMIN_USER}",
                outcome="ok",
                request_id="startup",
                tenant=DEFAULT_TENANT,
                detail={"token": secret.id},
            ),
            now,
        )
        write_secret_file(token_path, secret.token + "\n")
    log.info("created the first admin user %r; its token is in %s", ADMIN_USER, token_path)
    return True
