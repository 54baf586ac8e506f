"""The server's secret keys on disk (audit seal, webhook signing): hex in a 0600 file, made on
first start, shared by replicas that share a database."""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path

log = logging.getLogger("computepool.server")
KEY_BYTES = 32


def load_or_create_key(path: Path, what: str) -> bytes:
    """The `what` key (e.g. "audit") at `path`, made on first start; one readable by others is narrowed."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:  # O_EXCL: of two servers starting together on one data dir, the first key wins
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(KEY_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        log.info("made a new %s key in %s (replicas sharing this database need the same key)", what, path)
    text = path.read_text().strip()
    for _ in range(50):  # another server may be writing it this instant
        if text:
            break
        time.sleep(0.1)
        text = path.read_text().strip()
    if path.stat().st_mode & 0o077:
        log.warning("%s key %s was readable by others: mode set to 0600", what, path)
        path.chmod(0o600)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{path}: the {what} key must be hex (as the server writes it)") from None
    if len(key) < 16:
        raise ValueError(f"{path}: the {what} key is too short ({len(key)} bytes; at least 16)")
    return key
