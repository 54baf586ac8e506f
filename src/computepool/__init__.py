"""ComputePool: the GPUs and CPUs of many servers as one pool. `from computepool import Pool` is the SDK.

`Pool` is imported on first use only: the CLI imports this package too, and must start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from computepool.sdk import Pool, progress

__all__ = ["Pool", "progress"]


def __getattr__(name: str) -> Any:
    if name == "Pool":
        from computepool.sdk.pool import Pool  # noqa: PLC0415 - lazy on purpose

        return Pool
    if name == "progress":  # a job's step count, for the pool's speed table (sdk/progress.py)
        from computepool.sdk.progress import progress  # noqa: PLC0415 - lazy on purpose

        return progress
    raise AttributeError(f"module 'computepool' has no attribute {name!r}")
