"""The gateway against misbehaving callers and replicas: nothing answers 500, nothing leaks.

Replicas that fail are real TCP servers on loopback that misbehave in one chosen way (close,
reset, hang, answer too much, report absurd token counts); good ones are simulated engines.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from conftest import Api
from gateway_kit import Registry, engine, wait_until
from sqlalchemy import event, select, update
from starlette.types import Message

from computepool.server.gateway import Gateway
from computepool.server.gateway.usage import MAX_TOKENS, Tokens
from computepool.store.models import GatewayUsage, Service, Tenant

H = dict[str, str]
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"


class BadEngine:
    """A loopback server that reads each request whole, then misbehaves as `mode` says."""

    def __init__(self, mode: str, size: int = 0) -> None:
        self.mode, self.size = mode, size
        self.requests = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self._sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _read_request(self, conn: socket.socket) -> bool:
        data = b""
        while b"\r\n\r\n" not in data:
            got = conn.recv(65536)
            if not got:
                return False
            data += got
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            body += conn.recv(65536)
        if head.startswith(b"POST "):  # what the gateway forwards (not a controller's health check)
            self.requests += 1
        return True

    def _one(self, conn: socket.socket) -> None:
        with conn:
            if not self._read_request(conn):
                return
            if self.mode == "reset":  # an abortive close: the gateway reads a reset connection
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif self.mode == "hang":
                self._stop.wait(30)
            elif self.mode in ("big", "big-declared"):
                body = b'{"pad": "' + b"x" * self.size + b'"}'
                if self.mode == "big":
                    head = OK + b"transfer-encoding: chunked\r\n\r\n"
                    conn.sendall(head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
                else:
                    conn.sendall(OK + b"content-length: %d\r\n\r\n" % len(body) + body)
            elif self.mode == "huge-usage":
                answer = {
                    "choices": [{"text": "x"}],
                    "usage": {"prompt_tokens": 2**63, "completion_tokens": -5},
                }
                body = json.dumps(answer).encode()
                conn.sendall(OK + b"content-length: %d\r\n\r\n" % len(body) + body)
            elif self.mode == "stream-break":  # a stream that starts, then the engine dies
                head = (
                    OK.replace(b"application/json", b"text/event-stream")
                    + b"transfer-encoding: chunked\r\n\r\n"
                )
                event = b'data: {"choices": [{"text": "a"}]}\n\n'
                conn.sendall(head + b"%x\r\n%s\r\n" % (len(event), event))
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            # "close": nothing at all

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


@contextlib.contextmanager
def bad_engine(mode: str, size: int = 0) -> Iterator[BadEngine]:
    srv = BadEngine(mode, size)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def pool(api: Api) -> tuple[Api, Registry, H]:
    api.app.state.service_controller.auto = False  # the replicas here are the test's own: no health checks
    api.tenant("t1")
    return api, Registry(api.app.state.db), api.user("alice", "t1", "member")


def oa_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code"} and err["message"], err
    return dict(err)


def ask(api: Api, headers: H, model: str, **extra: Any) -> httpx.Response:
    return api.post("/v1/completions", json={"model": model, "prompt": "x", **extra}, headers=headers)


def listed(api: Api, headers: H, *names: str) -> None:
    """Wait until /v1/models shows the services (without sending them a request)."""

    def shown() -> bool:
        return set(names) <= {m["id"] for m in api.get("/v1/models", headers=headers).json()["data"]}

    wait_until(shown, 10, f"{names} to be listed")


def usage_total(api: Api, service: str, requests: int) -> dict[str, int]:
    def summed() -> dict[str, int] | None:
        items = api.ok("GET", "/api/v1/gateway/usage", params={"service": service})["items"]
        keys = ("requests", "failed", "prompt_tokens", "completion_tokens")
        total = {k: sum(i[k] for i in items) for k in keys}
        return total if total["requests"] == requests else None

    return dict(wait_until(summed, 15, f"usage of {service}"))


@pytest.mark.parametrize("backend", ["sqlite"])
def test_stream_whose_body_never_starts_frees_its_place(pool: tuple[Api, Registry, H]) -> None:
    api, reg, alice = pool
    gw: Gateway = api.app.state.gateway
    with engine(ms_per_token=50) as port:
        sid = reg.service("t1", "streamer")
        reg.replica(sid, port)
        wait_until(lambda: ask(api, alice, "streamer").status_code == 200, 10, "the service")
        body = json.dumps({"model": "streamer", "prompt": "go", "max_tokens": 50, "stream": True}).encode()
        token = alice["Authorization"].encode()
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("testserver", 80),
            "headers": [(b"authorization", token), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()), (b"host", b"testserver")],
        }  # fmt: skip

        async def call() -> list[str]:
            messages: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
            starts: list[str] = []

            async def receive() -> Message:
                return messages.pop(0) if messages else {"type": "http.disconnect"}

            async def send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    starts.append(str(message["status"]))
                    raise OSError("the caller is gone")  # as a server does when the socket closed

            with contextlib.suppress(Exception):
                await api.app(scope, receive, send)
            return starts

        assert api.client.portal is not None
        assert api.client.portal.call(call)[0] == "200"  # the answer was about to start
        assert gw.balancer.load(sid).inflight == 0  # at once: the place on the replica is free
        total = usage_total(api, "streamer", 2)
        assert total["failed"] == 0


@pytest.mark.parametrize("backend", ["sqlite"])
def test_replica_failures_answer_502_or_504_and_only_unsent_requests_are_retried(
    pool: tuple[Api, Registry, H],
) -> None:
    api, reg, alice = pool
    gw: Gateway = api.app.state.gateway
    gw.answer_timeout_s = 0.5
    gw.max_answer_bytes = 10_000
    with (
        engine(model="good") as port,
        bad_engine("close") as closer,
        bad_engine("reset") as resetter,
        bad_engine("hang") as hanger,
        bad_engine("big", 50_000) as big,
        bad_engine("big-declared", 50_000) as declared,
    ):
        sid = reg.service("t1", "dropper")
        reg.replica(sid, closer.port)  # first by id: the first request goes there
        reg.replica(sid, port)
        listed(api, alice, "dropper")
        # the engine may have run it: not sent again to the good replica
        err = oa_error(ask(api, alice, "dropper"), 502)
        assert err["code"] == "replica_error" and "RemoteProtocolError" in err["message"]
        assert closer.requests == 1
        assert ask(api, alice, "dropper").json()["model"] == "good"  # the dropper is skipped a while

        for name, srv in (("resetter", resetter), ("hanger", hanger), ("big", big), ("declared", declared)):
            reg.replica(reg.service("t1", name), srv.port)
        listed(api, alice, "resetter", "hanger", "big", "declared")
        assert oa_error(ask(api, alice, "resetter"), 502)["code"] == "replica_error"
        slow = oa_error(ask(api, alice, "hanger"), 504)  # the hanger never answers: only the timeout ends it
        assert slow["code"] == "replica_timeout" and "did not answer within 0.5 s" in slow["message"]
        for name in ("big", "declared"):
            large = oa_error(ask(api, alice, name), 502)
            assert large["code"] == "answer_too_large" and "limit of 10000 bytes" in large["message"]
        assert usage_total(api, "big", 1)["failed"] == 1
        assert all(gw.balancer.load(i.id).inflight == 0 for i in list(gw._by_id.values()))


def test_a_stream_broken_mid_answer_ends_with_an_error_event(pool: tuple[Api, Registry, H]) -> None:
    """The 200 has gone out: the client must read the failure in the stream, never a clean end."""
    api, reg, alice = pool
    with bad_engine("stream-break") as breaker:
        reg.replica(reg.service("t1", "breaker"), breaker.port)
        listed(api, alice, "breaker")
        r = ask(api, alice, "breaker", stream=True)
        assert r.status_code == 200
        events = [line[len("data:") :].strip() for line in r.text.splitlines() if line.startswith("data:")]
        assert events[0] == '{"choices": [{"text": "a"}]}' and "[DONE]" not in events, events
        err = json.loads(events[-1])["error"]
        assert err["code"] == "replica_error" and "failed mid-answer" in err["message"], events
        assert usage_total(api, "breaker", 1)["failed"] == 1


def test_absurd_token_counts_are_capped_and_usage_still_flows(pool: tuple[Api, Registry, H]) -> None:
    api, reg, alice = pool
    with bad_engine("huge-usage") as srv:
        reg.replica(reg.service("t1", "liar"), srv.port)
        wait_until(lambda: ask(api, alice, "liar").status_code == 200, 10, "the service")
        for _ in range(2):
            assert ask(api, alice, "liar").status_code == 200
        total = usage_total(api, "liar", 3)
        assert (total["prompt_tokens"], total["completion_tokens"]) == (3 * MAX_TOKENS, 0)


def test_a_row_the_database_refuses_does_not_block_the_others(pool: tuple[Api, Registry, H]) -> None:
    api, reg, alice = pool
    gw: Gateway = api.app.state.gateway
    db = api.app.state.db
    with engine() as port:
        reg.replica(reg.service("t1", "kept"), port)
        with db.read() as s:
            t1 = s.scalars(select(Tenant.id).where(Tenant.name == "t1")).one()
        # usage of a tenant that is gone (a foreign key the database refuses), counted beside t1's
        assert api.client.portal is not None
        api.client.portal.call(lambda: gw.usage.record(999_999, "ghost", "tok", "kept", False, Tokens(1, 1)))
        wait_until(lambda: ask(api, alice, "kept").status_code == 200, 10, "the service")
        total = usage_total(api, "kept", 1)
        assert total["failed"] == 0
        with db.read() as s:
            assert s.scalars(select(GatewayUsage.tenant_id).where(GatewayUsage.service == "kept")).all() == [
                t1
            ]


@pytest.mark.parametrize("backend", ["sqlite"])
def test_odd_input_answers_4xx_never_500(pool: tuple[Api, Registry, H]) -> None:
    api, _, alice = pool
    lone = api.post("/v1/completions", content=b'{"model": "a\\ud800b", "prompt": "x"}', headers=alice)
    assert oa_error(lone, 404)["message"] == "model 'a\\ud800b' not found"
    long = oa_error(ask(api, alice, "m" * 5000), 404)["message"]
    assert len(long) < 300
    deep = b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert oa_error(api.post("/v1/completions", content=deep, headers=alice), 400)["code"] == "invalid_json"
    for since in ("99999999999d", "0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00"):
        r = api.get("/api/v1/gateway/usage", headers=alice, params={"since": since})
        assert r.status_code == 422 and r.json()["field"] == "since", (since, r.text)
    for limit in ("0", "100001", "x"):
        r = api.get("/api/v1/gateway/usage", headers=alice, params={"limit": limit})
        assert r.status_code == 422 and "limit" in r.text, r.text


def test_queue_full_answers_503_at_once(pool: tuple[Api, Registry, H]) -> None:
    api, reg, alice = pool
    gw: Gateway = api.app.state.gateway
    reg.service("t1", "empty", queue_timeout_s=60)
    gw.balancer.max_waiters = 0  # no request may wait for this service's replicas
    wait_until(lambda: ask(api, alice, "empty").status_code != 404, 10, "the service")
    r = ask(api, alice, "empty")
    err = oa_error(r, 503)  # queue_full, not the queue's 60 s timeout: it never waited
    assert err["code"] == "queue_full" and "service 'empty'" in err["message"]
    assert r.headers["Retry-After"] == "1"


@pytest.mark.parametrize("backend", ["sqlite"])
def test_missing_models_do_not_read_the_table_per_request(pool: tuple[Api, Registry, H]) -> None:
    api, reg, alice = pool
    gw: Gateway = api.app.state.gateway
    reads: list[float] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if (
            statement.lstrip().upper().startswith("SELECT")
            and "FROM gateway_limits JOIN tenants" in statement
        ):
            reads.append(time.monotonic())

    engine_ = api.app.state.db.engine
    event.listen(engine_, "before_cursor_execute", count)
    try:
        t0 = time.monotonic()
        for i in range(8):
            path = "/v1/models" if i % 2 else "/v1/completions"
            r = api.get(path, headers=alice) if i % 2 else ask(api, alice, f"nope{i}")
            assert r.status_code in (200, 404)
        took = time.monotonic() - t0
    finally:
        event.remove(engine_, "before_cursor_execute", count)
    # the loop's reads (one per REFRESH_S) and at most a few more, not one per request
    assert len(reads) <= took / 0.5 + 3, (len(reads), took)
    # a service made a moment ago is still found by the next request
    reg.service("t1", "fresh")
    assert "fresh" in [m["id"] for m in api.get("/v1/models", headers=alice).json()["data"]]
    # a deleted service's entries leave the gateway's maps
    sid = reg.service("t1", "gone")
    with engine() as port:
        reg.replica(sid, port)
        assert ask(api, alice, "gone").status_code == 200
        wait_until(lambda: sid in gw._answered, 5, "the answer counted")
        with api.app.state.db.write() as s:
            s.execute(update(Service).where(Service.id == sid).values(deleted_at=datetime.now(UTC)))
        wait_until(lambda: sid not in gw._answered and sid not in gw._touched, 5, "the maps pruned")


def test_usage_retention_and_listing_limit(pool: tuple[Api, Registry, H]) -> None:
    api, _, alice = pool
    gw: Gateway = api.app.state.gateway
    db = api.app.state.db
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    wait_until(lambda: gw._pruned_at is not None, 10, "the flusher's first retention pass")
    with db.write() as s:
        t1 = s.scalars(select(Tenant.id).where(Tenant.name == "t1")).one()
        for days in (0, 1, 2, 399, 401, 800):
            s.add(GatewayUsage(tenant_id=t1, user="alice", token_id="tok", service="old",
                               hour=now - timedelta(days=days), requests=days + 1, failed=0,
                               prompt_tokens=0, completion_tokens=0))  # fmt: skip
    assert api.client.portal is not None
    assert api.client.portal.call(gw.prune_usage) == 2
    since = (now - timedelta(days=1000)).isoformat()
    listed = api.ok("GET", "/api/v1/gateway/usage", params={"since": since, "service": "old"})["items"]
    assert sorted(i["requests"] for i in listed) == [1, 2, 3, 400]
    two = api.get("/api/v1/gateway/usage", headers=alice, params={"since": since, "limit": 2}).json()
    assert [i["requests"] for i in two["items"]] == [400, 3]  # the oldest hours first
