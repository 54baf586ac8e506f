"""ComputePool: the GPUs and CPUs of many servers as one pool. `from computepool import Pool` is the SDK.

`Pool` is imported on first use only: the CLI imports this package too, and must start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from computepool.sdk import Pool

__all__ = ["Pool"]


def __getattr__(name: str) -> Any:
    if name == "Pool":
        from computepool.sdk.pool import Pool  # noqa: PLC0415 - lazy on purpose

        return Pool
    raise AttributeError(f"module 'computepool' has no attribute {name!r}")
