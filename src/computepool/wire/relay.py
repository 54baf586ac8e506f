"""Relay sessions: a shell in a running job (`cpool exec`) or one tunnelled TCP connection to a
port in its network namespace (`cpool forward`), carried over two WebSockets the server joins.

On both sockets binary frames are bytes, their first byte naming the stream (STDIN, STDOUT,
STDERR; a forwarded connection uses DATA both ways); text frames are small JSON control
messages: {"resize": [rows, cols]}, {"eof": true} (towards the job), {"exit": code} and
{"error": text} (towards the user).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from computepool.wire.common import In, Out

STDIN, STDOUT, STDERR, DATA = 0, 1, 2, 3
CLIENT_SECRET_HEADER = "X-Cpool-Relay-Secret"
RelayKind = Literal["exec", "forward"]
Arg = Annotated[str, StringConstraints(max_length=65536, pattern=r"^[^\x00]*$")]


class RelayCreate(In):
    kind: RelayKind = Field(description="exec: run `command` in the job; forward: connect to `port` in it.")
    rank: int = Field(default=0, strict=True, ge=0, le=10_000, description="Which member of a gang.")
    command: list[Arg] = Field(default_factory=list, max_length=4096, description="What to run (exec).")
    tty: bool = Field(default=False, description="Run the command on a pseudo-terminal (exec).")
    rows: int = Field(default=24, strict=True, ge=1, le=10_000, description="Terminal rows (tty).")
    cols: int = Field(default=80, strict=True, ge=1, le=10_000, description="Terminal columns (tty).")
    port: int = Field(default=0, strict=True, ge=0, le=65535, description="The job's port (forward).")
    check: bool = Field(default=False, description="Only check that it could start; no session.")


class RelayOut(Out):
    id: int = Field(description="The session (0 for a check).")
    allocation_id: int
    node: str
    rank: int
    secret: str = Field(description="The one-time secret that opens the session's socket.")
    url: str | None = Field(description="The replica to connect to (None: the one this answer came from).")
    expires_in_s: float


class PendingRelay(Out):
    """A session the node's agent should dial back to (its long-poll answer)."""

    id: int
    allocation_id: int
    attempt: int
    tenant: str
    kind: RelayKind
    command: list[str]
    tty: bool
    rows: int
    cols: int
    port: int
    secret: str
    url: str | None


class PendingRelays(Out):
    items: list[PendingRelay]
