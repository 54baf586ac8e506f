"""Bearer secrets of the form `<id>.<secret>`: the id is public and indexes the row, the secret is not.

The secret is 32 random bytes (256 bits), so the database keeps only its SHA-256. A slow,
salted password hash (bcrypt, argon2) defends *low-entropy* human passwords against guessing;
a uniformly random 256-bit secret cannot be guessed or looked up in a table, so one fast hash
is as strong here and keeps every request cheap. Comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

SECRET_BYTES = 32
ID_BYTES = 8
_TOKEN = re.compile(r"^([0-9a-f]{16})\.([A-Za-z0-9_-]{40,64})$")


@dataclass(frozen=True)
class NewSecret:
    id: str
    token: str  # shown once, never stored
    secret_hash: str


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> NewSecret:
    token_id = secrets.token_hex(ID_BYTES)
    secret = secrets.token_urlsafe(SECRET_BYTES)
    return NewSecret(id=token_id, token=f"{token_id}.{secret}", secret_hash=hash_secret(secret))


def split_token(token: str) -> tuple[str, str] | None:
    """(id, secret), or None when the text does not look like one of our tokens."""
    m = _TOKEN.match(token.strip())
    return (m.group(1), m.group(2)) if m else None


def secret_matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)
