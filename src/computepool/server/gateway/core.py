"""One gateway process: its routing table, queues, rate limits, usage and load reports.

Three loops keep it in step with the database, so that no request reads the database to be
routed: the table of services, ready replicas and limits is re-read every half second; the load
(requests in flight and queued, per service and replica) is written every half second for the
service controller; usage is added every two seconds. Requests are forwarded with one shared
HTTP client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta

import httpx
from fastapi.concurrency import run_in_threadpool

from computepool.server.caches import TokenCache
from computepool.server.gateway.balancer import Balancer, QueueFull, QueueTimeout, Replica
from computepool.server.gateway.limiter import RateLimiter
from computepool.server.gateway.relay import (
    MAX_ANSWER_BYTES,
    AnswerTooLarge,
    Relay,
    close_shielded,
    read_capped,
)
from computepool.server.gateway.usage import Tokens, UsageBook, tokens_in_body
from computepool.server.logic.service_load import Load, write_load
from computepool.server.loops import Periodic
from computepool.server.policy import Principal
from computepool.store import gateway as store
from computepool.store.db import Database, db_now

log = logging.getLogger("computepool.gateway")

REFRESH_S = 0.5
REPORT_S = 0.5
FLUSH_S = 2.0
SEEN_FOR_S = 600.0  # a service keeps being reported this long after its last request
TOUCH_EVERY_S = 1.0  # services.last_request_at is written at most this often per service
CONNECT_TIMEOUT_S = 5.0
ANSWER_TIMEOUT_S = 600.0  # a whole non-streamed answer; streams have no read timeout
STALE_S = 2 * REFRESH_S  # a table older than this (the loop late) is re-read for a missing model
USAGE_KEEP_DAYS = 400  # usage rows of older hours are deleted …
PRUNE_EVERY_S = 3600.0  # … by each gateway's flusher, at most this often


@dataclass(frozen=True)
class ServiceInfo:
    id: int
    tenant_id: int
    tenant: str
    name: str
    limit: int  # requests one replica is sent at once
    queue_timeout_s: float
    created: int  # unix seconds
    failing: str = ""  # the controller's reason while its replicas fail to start (engine exits …)


@dataclass(frozen=True)
class Caller:
    tenant_id: int
    user: str
    token_id: str
    service: ServiceInfo


@dataclass
class Answer:
    """What the router turns into a response: a whole body, or a stream of bytes."""

    status: int
    content_type: str
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    close: Callable[[], Awaitable[None]] | None = None  # a stream's cleanup; safe to call twice


class GatewayError(Exception):
    """An answer the gateway gives itself, in the OpenAI error shape."""

    def __init__(self, status: int, message: str, kind: str, code: str | None = None, **headers: str):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.headers = status, message, kind, code, headers


def printable(text: str, limit: int = 200) -> str:
    """`text` safe to put in a JSON answer: lone surrogates escaped, a long text cut."""
    safe = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return safe if len(safe) <= limit else safe[:limit] + "…"


def _info(row: store.ServiceRow) -> ServiceInfo:
    spec = row.spec
    target = int(spec.get("target_inflight") or 4)
    limit = int(spec.get("max_inflight") or 2 * target)
    return ServiceInfo(
        id=row.id,
        tenant_id=row.tenant_id,
        tenant=row.tenant,
        name=row.name,
        limit=limit,
        queue_timeout_s=float(spec.get("queue_timeout_s") or 120),
        created=int(row.created_at.timestamp()),
        failing=row.reason if _FAILING.search(row.reason) else "",
    )


# the service controller's words for replicas that ended failed or keep failing (service_controller.py)
_FAILING = re.compile(r"replica \d+ failed \(|replicas keep failing")


@dataclass(frozen=True)
class _Table:
    services: list[store.ServiceRow]
    replicas: list[store.ReplicaRow]
    limits: list[store.LimitRow]


def _read_table(db: Database) -> _Table:
    with db.read() as s:
        return _Table(store.live_services(s), store.ready_replicas(s), store.limits(s))


class Gateway:
    def __init__(
        self, db: Database, tokens: TokenCache, default_limit: tuple[int, int] | None = None
    ) -> None:
        """`default_limit`: (requests a minute, burst) of a tenant with no gateway limit of its own."""
        self.db = db
        self.tokens = tokens
        self.id = f"{socket.gethostname()[:100]}:{os.getpid()}:{secrets.token_hex(3)}"
        self.balancer = Balancer()
        self.limiter = RateLimiter(default_limit)
        self.usage = UsageBook()
        self._by_key: dict[tuple[str, str], ServiceInfo] = {}
        self._by_id: dict[int, ServiceInfo] = {}
        self._answered: dict[int, int] = {}
        self._seen: dict[int, float] = {}  # service id → monotonic time of its last request
        self._arrived: set[int] = set()  # services with a request since the last report
        self._touched: dict[int, float] = {}
        self._reporting = False  # rows of this gateway are in gateway_load
        self._read_at = 0.0  # monotonic time the table in use began to be read
        self._read_event = asyncio.Event()  # set (and replaced) whenever a new table is in use
        self._forced_at = -STALE_S  # monotonic time of the last read forced by a request
        self._pruned_at: float | None = None  # monotonic time usage retention last ran
        self._refresh_lock = asyncio.Lock()
        self.answer_timeout_s = ANSWER_TIMEOUT_S
        self.max_answer_bytes = MAX_ANSWER_BYTES
        self._client: httpx.AsyncClient | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            timeout=httpx.Timeout(ANSWER_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            trust_env=False,
        )
        with contextlib.suppress(Exception):  # the database away: the loop tries again
            await self.refresh()

    def periodic(self) -> list[Periodic]:
        """Its table re-read, its load reported, its usage flushed (each skipped while the database
        is away: the next round tries again)."""
        return [
            Periodic("gateway-refresh", REFRESH_S, self.refresh, quiet=True),
            Periodic("gateway-report", REPORT_S, self.report, quiet=True),
            Periodic("gateway-flush", FLUSH_S, self.flush, quiet=True),
        ]

    async def stop(self) -> None:
        """After the loops: the last usage flushed, the client closed."""
        with contextlib.suppress(Exception):
            await self.flush()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- the routing table ----------------------------------------------------------------------

    async def refresh(self, unless_read_since: float | None = None) -> None:
        """Re-read the table; with `unless_read_since`, only if it was read before that time (so
        that requests missing a service at once share one read)."""
        async with self._refresh_lock:
            if unless_read_since is not None and self._read_at >= unless_read_since:
                return
            started = time.monotonic()
            table = await run_in_threadpool(_read_table, self.db)
            self._read_at = started
            infos = [_info(r) for r in table.services]
            self._by_key = {(i.tenant, i.name): i for i in infos}
            self._by_id = {i.id: i for i in infos}
            per: dict[int, list[Replica]] = {i.id: [] for i in infos}
            for r in table.replicas:
                if r.service_id in per:
                    per[r.service_id].append(Replica(r.allocation_id, r.endpoint, r.key))
            for info in infos:
                self.balancer.update(info.id, per[info.id], info.limit)
            self.balancer.forget_missing(set(self._by_id))
            self.limiter.set_limits({x.tenant: (x.requests_per_minute, x.burst) for x in table.limits})
            live = self._by_id
            self._answered = {sid: n for sid, n in self._answered.items() if sid in live}
            self._touched = {sid: at for sid, at in self._touched.items() if sid in live}
            self._seen = {sid: at for sid, at in self._seen.items() if sid in live}
            self._arrived &= set(live)
            done, self._read_event = self._read_event, asyncio.Event()
            done.set()

    def service_info(self, service_id: int) -> ServiceInfo | None:
        """The service as the routing table last read it (None: not in it)."""
        return self._by_id.get(service_id)

    async def _table_after(self, arrived: float) -> None:
        """Wait until a table read that began after `arrived` is in use, so that a service made
        a moment ago is found: the loop's next read, or (when the loop is late and the table
        older than STALE_S) one read now, at most once per STALE_S however many ask."""
        give_up = arrived + 3 * STALE_S
        while self._read_at < arrived and time.monotonic() < give_up:
            now = time.monotonic()
            if now - self._read_at >= STALE_S and now - self._forced_at >= STALE_S:
                self._forced_at = now
                await self.refresh(unless_read_since=arrived)
                return
            wait = max(self._read_at, self._forced_at) + STALE_S - now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._read_event.wait(), max(wait, 0.01))

    async def visible(self, principal: Principal) -> list[ServiceInfo]:
        """The services /v1/models lists: the caller's tenant's (an admin's: all), from a table
        read after the call came (listing is rare; a service made a moment ago shows)."""
        with contextlib.suppress(Exception):
            await self._table_after(time.monotonic())
        if principal.role == "admin":
            return sorted(
                self._by_id.values(), key=lambda i: (i.tenant != principal.tenant, i.tenant, i.name)
            )
        return sorted((i for i in self._by_id.values() if i.tenant == principal.tenant), key=lambda i: i.name)

    def model_id(self, principal: Principal, info: ServiceInfo) -> str:
        return info.name if info.tenant == principal.tenant else f"{info.tenant}/{info.name}"

    async def find(self, principal: Principal, model: str) -> ServiceInfo:
        """The service `model` names for this caller; a 404 alike for missing and other tenants'."""
        tenant, name = principal.tenant or "", model
        if "/" in model and principal.role == "admin":
            tenant, name = model.split("/", 1)
        arrived = time.monotonic()
        info = self._by_key.get((tenant, name))
        if info is None:  # made a moment ago? wait for a table read after the request came
            with contextlib.suppress(Exception):
                await self._table_after(arrived)
            info = self._by_key.get((tenant, name))
        if info is None:
            raise GatewayError(
                404, f"model '{printable(model)}' not found", "invalid_request_error", "model_not_found"
            )
        return info

    # -- requests -------------------------------------------------------------------------------

    def admit(self, info: ServiceInfo) -> None:
        """Apply the tenant's rate limit and note the request (idle clock, load reports)."""
        wait = self.limiter.take(info.tenant)
        if wait is not None:
            raise GatewayError(
                429,
                f"tenant '{info.tenant}' is over its gateway rate limit; retry in {wait} s",
                "rate_limit_error",
                "rate_limit_exceeded",
                **{"Retry-After": str(wait)},
            )
        self._seen[info.id] = time.monotonic()
        self._arrived.add(info.id)

    async def forward(
        self, caller: Caller, path: str, body: bytes, content_type: str, streaming: bool
    ) -> Answer:
        """Send the request to a replica (queueing for one if all are busy) and bring back its
        answer. Only a request certainly not sent (the connection refused or not made in time)
        is tried again, once, on another replica: any later failure may have reached the engine."""
        assert self._client is not None, "gateway not started"
        info = caller.service
        deadline = time.monotonic() + info.queue_timeout_s
        tried: frozenset[int] = frozenset()
        while True:
            replica = await self._acquire(caller, deadline, tried)
            # fresh headers: the caller's own (its pool token above all) never reach the engine,
            # which is shown the replica's key instead
            headers = {"content-type": content_type, "accept": "application/json, text/event-stream"}
            if replica.key:
                headers["authorization"] = f"Bearer {replica.key}"
            read_timeout = None if streaming else self.answer_timeout_s
            request = self._client.build_request(
                "POST",
                replica.endpoint + path,
                content=body,
                headers=headers,
                timeout=httpx.Timeout(read_timeout, connect=CONNECT_TIMEOUT_S),
            )
            try:
                response = await self._client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                self.balancer.release(info.id, replica)
                self.balancer.mark_bad(replica)
                if not tried:
                    tried = frozenset({replica.allocation_id})
                    log.info("replica %d of %s unreachable (%s); trying another", replica.allocation_id,
                             info.name, type(e).__name__)  # fmt: skip
                    continue
                self._done(caller, failed=True)
                raise self._replica_error(info, replica, e) from None
            except httpx.HTTPError as e:  # sent, or perhaps sent: never tried again
                self.balancer.release(info.id, replica)
                if not isinstance(e, httpx.TimeoutException):
                    self.balancer.mark_bad(replica)
                self._done(caller, failed=True)
                raise self._replica_error(info, replica, e) from None
            except BaseException:
                self.balancer.release(info.id, replica)
                self._done(caller, failed=True)
                raise
            return await self._answer(caller, replica, response)

    def _replica_error(self, info: ServiceInfo, replica: Replica, e: Exception) -> GatewayError:
        """A replica's failure in the OpenAI shape: 504 when it was too slow, else 502."""
        where = f"replica {replica.allocation_id} of service '{info.name}'"
        if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
            return GatewayError(502, f"{where} could not be reached", "server_error", "replica_unreachable")
        if isinstance(e, httpx.TimeoutException):
            return GatewayError(
                504,
                f"{where} did not answer within {self.answer_timeout_s:g} s",
                "server_error",
                "replica_timeout",
            )
        if isinstance(e, AnswerTooLarge):
            return GatewayError(
                502,
                f"{where} answered more than the gateway's limit of {self.max_answer_bytes} bytes",
                "server_error",
                "answer_too_large",
            )
        return GatewayError(
            502, f"{where} failed while answering ({type(e).__name__})", "server_error", "replica_error"
        )

    async def _acquire(self, caller: Caller, deadline: float, tried: frozenset[int]) -> Replica:
        info = caller.service
        if info.failing and not self.balancer.has_replicas(info.id):  # no point waiting: say why
            self._done(caller, failed=True)
            raise GatewayError(
                503,
                f"service '{info.name}' has no ready replica, and they fail: {printable(info.failing, 600)}",
                "server_error",
                "replicas_failing",
                **{"Retry-After": "5"},
            )
        try:
            return await self.balancer.acquire(
                info.id, max(0.0, deadline - time.monotonic()), tried, tenant=info.tenant
            )
        except QueueTimeout:
            self._done(caller, failed=True)
            raise GatewayError(
                503,
                f"no replica of service '{info.name}' became free within {info.queue_timeout_s:g} s",
                "server_error",
                "queue_timeout",
                **{"Retry-After": "1"},
            ) from None
        except QueueFull as e:
            self._done(caller, failed=True)
            whose = f"tenant '{info.tenant}'" if e.of_tenant else f"service '{info.name}'"
            raise GatewayError(
                503,
                f"queue full: {whose} already has {e.limit} requests waiting",
                "server_error",
                "queue_full",
                **{"Retry-After": "1"},
            ) from None

    async def _answer(self, caller: Caller, replica: Replica, response: httpx.Response) -> Answer:
        info = caller.service
        content_type = response.headers.get("content-type", "application/json")
        if content_type.startswith("text/event-stream"):
            relay = Relay(
                response,
                release=lambda: self.balancer.release(info.id, replica),
                record=lambda failed, tokens: self._done(caller, failed=failed, tokens=tokens),
            )
            return Answer(response.status_code, content_type, stream=relay.chunks(), close=relay.close)
        try:
            body = await read_capped(response, self.max_answer_bytes)
        except (httpx.HTTPError, AnswerTooLarge) as e:
            self._done(caller, failed=True)
            raise self._replica_error(info, replica, e) from None
        finally:
            self.balancer.release(info.id, replica)
            await close_shielded(response)
        ok = response.status_code < 400
        tokens = tokens_in_body(body) if ok else Tokens()
        self._done(caller, failed=response.status_code >= 500, tokens=tokens)
        return Answer(response.status_code, content_type, body=body)

    def _done(self, caller: Caller, failed: bool, tokens: Tokens | None = None) -> None:
        sid = caller.service.id
        self._answered[sid] = self._answered.get(sid, 0) + 1
        self.usage.record(
            caller.tenant_id, caller.user, caller.token_id, caller.service.name, failed, tokens or Tokens()
        )

    # -- reports --------------------------------------------------------------------------------

    def loads(self) -> dict[int, Load]:
        now = time.monotonic()
        return {
            sid: self.balancer.load(sid)
            for sid, at in self._seen.items()
            if now - at <= SEEN_FOR_S and sid in self._by_id
        }

    async def report(self) -> None:
        now = time.monotonic()
        self._seen = {sid: at for sid, at in self._seen.items() if now - at <= SEEN_FOR_S}
        loads = self.loads()
        touch = {sid for sid in self._arrived if now - self._touched.get(sid, 0.0) >= TOUCH_EVERY_S}
        self._arrived -= touch
        answered = dict(self._answered)
        if not loads and not touch and not self._reporting:
            return  # nothing to say, and no rows of ours left: an idle gateway writes nothing

        def write() -> None:
            with self.db.write() as s:
                at = db_now(s)
                write_load(s, self.id, loads, answered, at)
                store.touch_services(s, touch & set(self._by_id), at)

        try:
            await run_in_threadpool(write)
        except Exception:
            self._arrived |= touch  # written with the next report
            raise
        for sid in touch:
            self._touched[sid] = now
        self._reporting = bool(loads)

    async def flush(self) -> None:
        """Add the usage counted since the last flush; rows the database refuses are dropped
        (logged), the others kept. About once an hour, also delete usage past its retention."""
        now = time.monotonic()
        if self._pruned_at is None or now - self._pruned_at >= PRUNE_EVERY_S:
            self._pruned_at = now
            await self.prune_usage()
        counts = self.usage.take()
        if not counts:
            return

        def write() -> list[store.UsageKey]:
            with self.db.write() as s:
                return store.add_usage(s, counts)

        try:
            refused = await run_in_threadpool(write)
        except Exception:
            self.usage.put_back(counts)
            raise
        for key in refused:
            log.warning("usage of tenant %d, service %s dropped: the database refused it", key[0], key[3])

    async def prune_usage(self) -> int:
        """Delete usage rows older than USAGE_KEEP_DAYS; returns how many."""

        def delete() -> int:
            with self.db.write() as s:
                return store.delete_usage_before(s, db_now(s) - timedelta(days=USAGE_KEEP_DAYS))

        return await run_in_threadpool(delete)
