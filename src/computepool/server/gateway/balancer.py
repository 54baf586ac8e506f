"""Which replica answers a request: the ready one with the fewest requests in flight, else a queue.

All of it runs on the gateway's event loop (no locks): `acquire` hands out a replica and counts
the request on it, `release` uncounts it and gives the freed place to the oldest waiter. Each
service's waiters form one FIFO queue, so a burst is served in the order it came.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from computepool.server.logic.service_load import Load

BAD_REPLICA_S = 5.0  # a replica that refused a connection gets no request for this long
MAX_WAITERS = 1_000  # requests one service's queue holds; more answer 503 at once
MAX_TENANT_WAITERS = 2_000  # requests one tenant's services' queues hold together


@dataclass(frozen=True)
class Replica:
    allocation_id: int
    endpoint: str  # http://ADDRESS:PORT
    key: str | None = field(default=None, repr=False)  # shown to the engine as a bearer token


class QueueTimeout(Exception):
    """No replica became free within the service's queue timeout."""


class QueueFull(Exception):
    """The service's queue, or all its tenant's queues together, hold as many requests as allowed."""

    def __init__(self, limit: int, of_tenant: bool) -> None:
        super().__init__(limit)
        self.limit, self.of_tenant = limit, of_tenant


@dataclass
class _Waiter:
    future: asyncio.Future[Replica]
    exclude: frozenset[int]


@dataclass
class _Service:
    limit: int  # requests one replica is sent at once
    replicas: list[Replica] = field(default_factory=list)
    inflight: dict[int, int] = field(default_factory=dict)  # allocation id → requests on it
    waiters: deque[_Waiter] = field(default_factory=deque)
    turn: int = 0  # round robin among equally loaded replicas


class Balancer:
    def __init__(self, max_waiters: int = MAX_WAITERS, max_tenant_waiters: int = MAX_TENANT_WAITERS) -> None:
        self._services: dict[int, _Service] = {}
        self._bad_until: dict[int, float] = {}
        self.max_waiters, self.max_tenant_waiters = max_waiters, max_tenant_waiters
        self._tenant_waiting: dict[str, int] = {}  # tenant → its requests waiting in any queue

    def _service(self, service_id: int, limit: int = 1) -> _Service:
        svc = self._services.get(service_id)
        if svc is None:
            svc = self._services[service_id] = _Service(limit=limit)
        return svc

    def update(self, service_id: int, replicas: Iterable[Replica], limit: int) -> None:
        """The ready replicas as last read: new ones take waiting requests at once; requests on
        a replica no longer listed (draining, ended) stay counted until they finish."""
        svc = self._service(service_id, limit)
        svc.limit = limit
        svc.replicas = sorted(replicas, key=lambda r: r.allocation_id)
        listed = {r.allocation_id for r in svc.replicas}
        svc.inflight = {a: n for a, n in svc.inflight.items() if n > 0 or a in listed}
        self._dispatch(svc)

    def has_replicas(self, service_id: int) -> bool:
        """Whether the service has a ready replica (busy or not) as last read."""
        svc = self._services.get(service_id)
        return bool(svc and svc.replicas)

    def forget_missing(self, service_ids: set[int]) -> None:
        """Drop services that are gone, once nothing of theirs is in flight or waiting."""
        for sid in list(self._services):
            svc = self._services[sid]
            if sid not in service_ids and not svc.waiters and not any(svc.inflight.values()):
                del self._services[sid]
            elif sid not in service_ids:
                svc.replicas = []
        now = time.monotonic()
        self._bad_until = {a: t for a, t in self._bad_until.items() if t > now}

    def _pick(self, svc: _Service, exclude: frozenset[int]) -> Replica | None:
        now = time.monotonic()
        free = [
            r
            for r in svc.replicas
            if r.allocation_id not in exclude
            and self._bad_until.get(r.allocation_id, 0.0) <= now
            and svc.inflight.get(r.allocation_id, 0) < svc.limit
        ]
        if not free:
            return None
        low = min(svc.inflight.get(r.allocation_id, 0) for r in free)
        ties = [r for r in free if svc.inflight.get(r.allocation_id, 0) == low]
        chosen = ties[svc.turn % len(ties)]
        svc.turn += 1
        svc.inflight[chosen.allocation_id] = svc.inflight.get(chosen.allocation_id, 0) + 1
        return chosen

    def _dispatch(self, svc: _Service) -> None:
        while svc.waiters:
            head = svc.waiters[0]
            if head.future.done():  # timed out or cancelled meanwhile
                svc.waiters.popleft()
                continue
            replica = self._pick(svc, head.exclude)
            if replica is None:
                return
            svc.waiters.popleft()
            head.future.set_result(replica)

    async def acquire(
        self, service_id: int, timeout_s: float, exclude: frozenset[int] = frozenset(), tenant: str = ""
    ) -> Replica:
        """A replica, counted as busy with this request; waits in the service's queue (FIFO)
        while none is free. Raises QueueTimeout after `timeout_s`, and QueueFull at once when
        the service's queue or the tenant's queues are full (waiters cost memory)."""
        svc = self._service(service_id)
        if not svc.waiters:
            replica = self._pick(svc, exclude)
            if replica is not None:
                return replica
        if len(svc.waiters) >= self.max_waiters:
            raise QueueFull(self.max_waiters, of_tenant=False)
        waiting = self._tenant_waiting.get(tenant, 0)
        if waiting >= self.max_tenant_waiters:
            raise QueueFull(self.max_tenant_waiters, of_tenant=True)
        self._tenant_waiting[tenant] = waiting + 1
        waiter = _Waiter(asyncio.get_running_loop().create_future(), exclude)
        svc.waiters.append(waiter)
        try:
            return await asyncio.wait_for(waiter.future, timeout_s)
        except BaseException as exc:
            fut = waiter.future
            if waiter in svc.waiters:
                svc.waiters.remove(waiter)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(service_id, fut.result())  # handed a replica just as we gave up
            if isinstance(exc, TimeoutError):
                raise QueueTimeout() from None
            raise
        finally:
            left = self._tenant_waiting.get(tenant, 1) - 1
            if left > 0:
                self._tenant_waiting[tenant] = left
            else:
                self._tenant_waiting.pop(tenant, None)

    def release(self, service_id: int, replica: Replica) -> None:
        svc = self._service(service_id)
        left = svc.inflight.get(replica.allocation_id, 0) - 1
        if left > 0 or replica in svc.replicas:
            svc.inflight[replica.allocation_id] = max(left, 0)
        else:
            svc.inflight.pop(replica.allocation_id, None)
        self._dispatch(svc)

    def mark_bad(self, replica: Replica) -> None:
        self._bad_until[replica.allocation_id] = time.monotonic() + BAD_REPLICA_S

    def load(self, service_id: int) -> Load:
        svc = self._services.get(service_id)
        if svc is None:
            return Load(0, 0, {})
        per = {r.allocation_id: 0 for r in svc.replicas}
        per.update({a: n for a, n in svc.inflight.items() if n > 0})
        queued = sum(1 for w in svc.waiters if not w.future.done())
        return Load(sum(per.values()), queued, per)
