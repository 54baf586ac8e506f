"""Blobs (content-addressed bytes a tenant holds) and file requests (a job's files, fetched back)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field, StringConstraints

from computepool.core.states import FileState
from computepool.wire.common import In, Out

Sha256 = Annotated[
    str,
    StringConstraints(pattern=r"^[0-9a-f]{64}$"),
    Field(description="A blob's SHA-256, 64 lower-case hex digits (upload it first: PUT /blobs/{sha256})."),
]
JobPath = Annotated[
    str,
    StringConstraints(min_length=1, max_length=1024, pattern=r"^[^\x00]+$"),
    Field(description="A file or directory relative to the job's work dir, e.g. out/model.pt."),
]


class BlobOut(Out):
    sha256: str
    size: int
    created: bool = Field(description="False when the tenant held these bytes already.")
    tenant_bytes: int = Field(description="Bytes the tenant holds now, against its cap.")


class FileRequestCreate(In):
    path: JobPath
    rank: int | None = Field(
        default=None, strict=True, ge=0, le=10_000, description="Which member of a gang (default 0)."
    )


class FileRequestOut(Out):
    id: int
    allocation_id: int
    attempt: int
    node: str
    rank: int
    path: str
    state: FileState
    blob: str | None = Field(description="The tar.gz of the path (GET /blobs/{sha256}) once done.")
    size: int | None
    error: str = Field(description="Why it failed: no such file, over the cap, the job's dir gone.")
    created_at: datetime
    ended_at: datetime | None


class PendingFile(Out):
    """A file request the node's agent should answer (part of its assignments answer)."""

    id: int
    allocation_id: int
    attempt: int
    tenant: str
    path: str


class FileFailure(In):
    error: str = Field(min_length=1, max_length=1000)
