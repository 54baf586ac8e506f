"""The hub's wake-up topics, named in one place: whoever changes a thing and whoever waits on it
must spell its topic the same way, and an allocation that ends wakes both its waiters and its log
followers (`ended`), so no path can forget one of them."""

from __future__ import annotations

from collections.abc import Iterable

ALERTS = "alerts"  # alerts fired or resolved (the dashboard's live view)


def node(name: str) -> str:
    """A node's assignments changed (its agent's long-poll)."""
    return f"node:{name}"


def nodes(names: Iterable[str]) -> list[str]:
    return [node(n) for n in names]


def alloc(alloc_id: int) -> str:
    """An allocation's state changed (`wait` on GET /allocations/{id})."""
    return f"alloc:{alloc_id}"


def allocs(alloc_ids: Iterable[int]) -> list[str]:
    return [alloc(i) for i in alloc_ids]


def logs(alloc_id: int) -> str:
    """New output of an allocation, or its end (`logs -f`)."""
    return f"logs:{alloc_id}"


def ended(alloc_ids: Iterable[int]) -> list[str]:
    """Allocations that ended: their state's waiters and their log followers."""
    return [t for i in alloc_ids for t in (alloc(i), logs(i))]


def files(request_id: int) -> str:
    """A file request was answered."""
    return f"files:{request_id}"


def service(service_id: int) -> str:
    return f"service:{service_id}"


def fn_calls(function_id: int) -> str:
    """A function's call queue (its waiting workers)."""
    return f"fn:{function_id}"


def fn_results(function_id: int) -> str:
    """A function's results and output (its waiting callers)."""
    return f"fnres:{function_id}"
