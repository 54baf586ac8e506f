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
import secrets
import time
from pathlib import Path

from computepool.server import keyfile

log = logging.getLogger("computepool.server")
TIMESTAMP_HEADER = "X-ComputePool-Timestamp"
SIGNATURE_HEADER = "X-ComputePool-Signature"
DELIVERY_HEADER = "X-ComputePool-Delivery"
SALT_BYTES = 16


def load_or_create_key(path: Path) -> bytes:
    """The webhook key (hex in a 0600 file), made on first start."""
    return keyfile.load_or_create_key(path, "webhook")


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
