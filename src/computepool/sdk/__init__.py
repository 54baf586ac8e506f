"""The Python SDK: `Pool` and `@pool.function` (remote functions on pooled slices), see docs/sdk.md."""

from __future__ import annotations

from computepool.sdk.errors import CallCancelled, IncompatiblePython, RemoteError, RemoteTraceback
from computepool.sdk.gang import GangHandle
from computepool.sdk.jobs import Job
from computepool.sdk.pool import Handle, Pool, RemoteFunction
from computepool.sdk.progress import progress

__all__ = [
    "CallCancelled",
    "GangHandle",
    "Handle",
    "IncompatiblePython",
    "Job",
    "Pool",
    "RemoteError",
    "RemoteFunction",
    "RemoteTraceback",
    "progress",
]
