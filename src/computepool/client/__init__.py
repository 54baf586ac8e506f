"""The pool's HTTP client: `PoolClient` for every API call, config resolution, the API benchmark.

Typical use: `with PoolClient.from_config(resolve_config()) as pool:` then
`pool.create_allocation(AllocationCreate.unchecked(gpus=1, gpu_milli=500))`.
"""

from __future__ import annotations

from computepool.client.config import DEFAULT_SERVER, ClientConfig, config_path, resolve_config, save_config
from computepool.client.errors import PoolError, ServerUnreachable
from computepool.client.http import PoolClient

__all__ = [
    "DEFAULT_SERVER",
    "AllocationCreate",
    "ClientConfig",
    "PoolClient",
    "PoolError",
    "ServerUnreachable",
    "config_path",
    "resolve_config",
    "save_config",
]


def __getattr__(name: str) -> object:
    """`AllocationCreate` (the wire's model) on first use: the CLI's start-up never loads pydantic."""
    if name == "AllocationCreate":
        from computepool.wire.allocations import AllocationCreate  # noqa: PLC0415

        return AllocationCreate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
