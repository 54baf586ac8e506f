"""The stored API request (the wire's `AllocationCreate`, as JSON) as the scheduler's `Request`.

The one place where the API's words (`gpus`, `exclusive`, `mig`) meet the scheduler's own
(`gpu_count`, `sharing`, `mig_profile`); an error names the API's field, never the scheduler's.
"""

from __future__ import annotations

from typing import Any

from computepool.core import InvalidInput, Isolation, Request, Sharing

_CORE_FIELD = {"gpu_count": "gpus", "sharing": "isolation"}


def to_core(req: dict[str, Any]) -> Request:
    """The stored API request as the scheduler's `Request` (raises InvalidInput naming API fields)."""
    gpus = int(req["gpus"])
    try:
        return Request(
            gpu_count=gpus,
            gpu_milli=int(req["gpu_milli"]) if gpus else 0,
            gpu_memory_mib=req.get("gpu_memory_mib") if gpus else None,
            cpu_milli=int(req["cpu_milli"]),
            memory_mib=int(req["memory_mib"]),
            models=frozenset(req["models"]) if req.get("models") else None,
            vendors=frozenset(req["vendors"]) if req.get("vendors") else None,
            min_gpu_memory_mib=int(req.get("min_gpu_memory_mib") or 0) if gpus else 0,
            sharing=Sharing.EXCLUSIVE if req.get("exclusive") else Sharing.SHARED,
            gang_nodes=int(req["gang_nodes"]),
            priority=int(req["priority"]),
            tenant=str(req["tenant"]),
            name=str(req.get("name") or ""),
            node_selector=tuple(sorted((req.get("node_selector") or {}).items())),
            stacks=tuple(sorted((req.get("stacks") or {}).items())),
            tolerations=frozenset(req.get("tolerations") or ()),
            isolation=Isolation(req["isolation"]) if req.get("isolation") else None,
            mig_profile=req.get("mig"),
            colocate=req.get("colocate"),
        )
    except InvalidInput as e:
        raise InvalidInput(_CORE_FIELD.get(e.where, e.where), e.message) from e


def stored_core(req: dict[str, Any]) -> Request:
    """`to_core` for a stored request. One stored before a tier rule it breaks was enforced (two
    devices with `mps` or `mig`) is read without its tier rather than stopping every cycle."""
    try:
        return to_core(req)
    except InvalidInput:
        if req.get("isolation") not in ("mps", "mig"):
            raise
        return to_core({**req, "isolation": None, "mig": None})
