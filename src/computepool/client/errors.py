"""What can go wrong when talking to the pool, as two exceptions a caller can print as one line."""

from __future__ import annotations


class PoolError(Exception):
    """The server answered with an error: its status, its message and the field at fault, if any.

    Built from the server's `{"error": ..., "field": ...}` body so the CLI can repeat the
    server's own words instead of a bare status code.
    """

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(f"{message} (HTTP {status})")
        self.status = status
        self.message = message
        self.field = field


class ServerUnreachable(Exception):
    """No answer at all (refused, DNS, timeout): says which address was tried and how to fix it."""

    def __init__(self, server: str, cause: str, *, tls: bool = False) -> None:
        hint = (
            "" if tls else "; is `cpool server` running? set --server, CPOOL_SERVER or `cpool login --server`"
        )
        super().__init__(f"cannot reach the pool server at {server} ({cause}){hint}")
        self.server = server
        self.cause = cause
