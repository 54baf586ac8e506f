"""Webhook secrets and signatures.

A webhook's secret is never stored: it is HMAC-SHA256(webhook key, "webhook:<id>:<salt>"), derived
again when a notification is signed, so the database alone (a backup, a dump) cannot forge one. The
salt is random per webhook, so a webhook that gets a deleted one's id never gets its secret. The key
is a file (DATA_DIR/webhook-key, 0600, made on first start; replicas sharing a database share it).
A notification carries `X-ComputePool-Timestamp` (unix seconds), `X-ComputePool-Signature:
sha256=<hex HMAC-SHA256(secret, timestamp + "." + body)>` and `X-ComputePool-Delivery` (the same on
every retry of one notification): the timestamp lets receivers refuse replays of old
notifications, the delivery id lets them drop a repeat.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from pathlib import Path

log = logging.getLogger("computepool.server")
KEY_BYTES = 32
TIMESTAMP_HEADER = "X-ComputePool-Timestamp"
SIGNATURE_HEADER = "X-ComputePool-Signature"
DELIVERY_HEADER = "X-ComputePool-Delivery"
SALT_BYTES = 16


def load_or_create_key(path: Path) -> bytes:
    """The webhook key (hex in a 0600 file), made on first start; one readable by others is narrowed."""
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
        log.info("made a new webhook key in %s (replicas sharing this database need the same key)", path)
    text = path.read_text().strip()
    for _ in range(50):  # another server may be writing it this instant
        if text:
            break
        time.sleep(0.1)
        text = path.read_text().strip()
    if path.stat().st_mode & 0o077:
        log.warning("webhook key %s was readable by others: mode set to 0600", path)
        path.chmod(0o600)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{path}: the webhook key must be hex (as the server writes it)") from None
    if len(key) < 16:
        raise ValueError(f"{path}: the webhook key is too short ({len(key)} bytes; at least 16)")
    return key


def new_salt() -> str:
    return secrets.token_hex(SALT_BYTES)


def webhook_secret(key: bytes, hook_id: int, salt: str) -> str:
    """The secret of webhook `hook_id`; webhooks made before salts existed have salt "" and keep
    the secret they were given."""
    message = f"webhook:{hook_id}:{salt}" if salt else f"webhook:{hook_id}"
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def signature(secret: str, timestamp: str, body: bytes) -> str:
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={mac}"


def signed_headers(secret: str, body: bytes, delivery_id: int, now: float | None = None) -> dict[str, str]:
    ts = str(int(time.time() if now is None else now))
    return {
        "Content-Type": "application/json",
        TIMESTAMP_HEADER: ts,
        SIGNATURE_HEADER: signature(secret, ts, body),
        DELIVERY_HEADER: str(delivery_id),
    }
