"""Sealing tenants' secrets at rest: AES-256-GCM under a key derived from the server's secrets key
file (DATA_DIR/secrets-key, 0600, made on first start; replicas sharing a database need the same
file). Each ciphertext is bound to its tenant and name (associated data), so one copied onto
another tenant's row or name does not open.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from computepool.server import keyfile
from computepool.store import secrets as store
from computepool.store.db import Database

PREFIX = "v1."
NONCE_BYTES = 12


class SecretUnreadable(Exception):
    """A stored ciphertext this server's key does not open (another key file, or altered)."""


@dataclass(frozen=True)
class SecretBox:
    aead: AESGCM

    @classmethod
    def from_key(cls, key: bytes) -> SecretBox:
        derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"computepool secrets v1")
        return cls(AESGCM(derived.derive(key)))

    @classmethod
    def load(cls, path: Path) -> SecretBox:
        """The box of the key at `path`, which is made (0600) when there is none yet."""
        return cls.from_key(keyfile.load_or_create_key(path, "secrets"))

    def seal(self, tenant_id: int, name: str, value: str) -> str:
        nonce = os.urandom(NONCE_BYTES)
        sealed = self.aead.encrypt(nonce, value.encode(), _bound(tenant_id, name))
        return PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode()

    def open(self, tenant_id: int, name: str, ciphertext: str) -> str:
        if not ciphertext.startswith(PREFIX):
            raise SecretUnreadable(f"secret '{name}' is not in a format this server reads")
        try:
            raw = base64.urlsafe_b64decode(ciphertext[len(PREFIX) :])
            plain = self.aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], _bound(tenant_id, name))
        except (InvalidTag, ValueError):
            raise SecretUnreadable(
                f"secret '{name}' does not open with this server's secrets key: replicas sharing a "
                "database must share one secrets key file"
            ) from None
        return plain.decode()


def _bound(tenant_id: int, name: str) -> bytes:
    return f"{tenant_id}\x00{name}".encode()


def prepare(db: Database, path: Path) -> None:
    """At start: make the key (so replicas can be given a copy) and refuse to serve with a key that
    does not open the secrets the database already holds."""
    box = SecretBox.load(path)
    with db.read() as s:
        some = store.any_one(s)
        if some is not None:
            try:
                box.open(some.tenant_id, some.name, some.ciphertext)
            except SecretUnreadable as e:
                raise RuntimeError(f"{path}: {e}") from None
