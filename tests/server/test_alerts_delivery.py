"""Notifications under hostile conditions: a receiver trickling its answer a byte at a time holds
up no other delivery and is given up at its deadline; a result is recorded only under a claim
still held; a reused webhook id gets a secret of its own; a webhook URL's secret parts never
reach the audit log, a delivery's error or the server's log."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pytest
from harness import Api
from test_alerts import Passes, beat
from test_alerts_notify import SICK, Receiver, verify
from test_allocations import join

from computepool.store import alerts as store
from computepool.store.db import db_now


class Trickler:
    """A receiver that reads the request, then answers one byte every `every_s`, forever."""

    def __init__(self, every_s: float = 0.3) -> None:
        self.every_s = every_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/slow"
        self.requests = 0
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            self.requests += 1
            answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n" + b"X-Pad: " + b"x" * 10_000
            for i in range(len(answer)):
                if self.closed.wait(self.every_s):
                    return
                try:
                    conn.sendall(answer[i : i + 1])
                except OSError:
                    return

    def close(self) -> None:
        self.closed.set()
        self.sock.close()


@pytest.fixture
def trickler() -> Iterator[Trickler]:
    t = Trickler()
    yield t
    t.close()


@dataclass(frozen=True)
class Seen:
    webhook_id: int | None
    state: str
    attempts: int
    last_error: str
    next_at: datetime
    created_at: datetime


def store_deliveries(api: Api) -> list[Seen]:
    with api.app.state.db.read() as s:
        return [
            Seen(d.webhook_id, d.state, d.attempts, d.last_error, d.next_at, d.created_at)
            for d in store.deliveries(s)
        ]


def test_a_trickling_receiver_holds_up_no_other_and_is_given_up_at_its_deadline(
    api: Api, trickler: Trickler
) -> None:
    fast = Receiver()
    try:
        p = Passes(api)
        notifier = p.engine.notifier
        notifier.deadline_s = 10.0  # far longer than the steps below take, even on a busy machine
        notifier.auto = True  # its own loop, as in a running server
        slow_hook = api.ok("POST", "/api/v1/webhooks", json={"url": trickler.url})
        api.ok("POST", "/api/v1/webhooks", json={"url": fast.url})
        node = join(api, "n1", devices=2)
        beat(api, "n1", node, {0: SICK})
        t0 = time.monotonic()
        assert p.run().fired == [("device-unhealthy", "device/n1/0")]
        while (not fast.got or not trickler.requests) and time.monotonic() - t0 < 5:
            time.sleep(0.02)
        assert fast.got and trickler.requests == 1
        # while the slow receiver is still trickling, a second alert reaches the fast one at once
        beat(api, "n1", node, {0: SICK, 1: SICK})
        t1 = time.monotonic()
        assert p.run().fired == [("device-unhealthy", "device/n1/1")]
        while len(fast.got) < 2 and time.monotonic() - t1 < 5:
            time.sleep(0.02)
        assert len(fast.got) == 2
        # ... while the slow delivery is still in flight: the fast one did not wait for it
        assert not [d for d in store_deliveries(api) if d.webhook_id == slow_hook["id"] and d.attempts]
        assert json.loads(fast.got[1][1])["alert"]["subject"] == "device/n1/1"
        # the slow one is given up on at its deadline (not after its 10 kB answer, ~50 minutes)
        first: list[Any] = []
        while time.monotonic() - t0 < 60:
            first = [d for d in store_deliveries(api) if d.webhook_id == slow_hook["id"] and d.attempts]
            if first:
                break
            time.sleep(0.05)
        assert first, "the trickling delivery was never given up"
        assert first[0].state == "pending" and "Timeout" in first[0].last_error
        assert first[0].next_at > first[0].created_at + timedelta(seconds=4)  # retried, with back-off
    finally:
        fast.close()


def test_a_result_is_recorded_only_under_a_claim_still_held(api: Api) -> None:
    p = Passes(api)
    notifier = p.engine.notifier
    api.ok("POST", "/api/v1/webhooks", json={"url": "http://127.0.0.1:9/never"})
    node = join(api, "n1", devices=1)
    beat(api, "n1", node, {0: SICK})
    p.run()
    with api.app.state.db.read() as s:
        now = db_now(s)
    mine = notifier._claim(now, 10)
    [job] = mine.jobs
    # this sender stalls past its claim; another replica takes the delivery and sends it
    theirs = notifier._claim(mine.until + timedelta(seconds=1), 10)
    assert [j.due.id for j in theirs.jobs] == [job.due.id]
    with api.app.state.db.write() as s:
        assert not store.finish(s, job.due, mine.until, "sent", now, "")  # the stale result: dropped
        assert store.finish(s, theirs.jobs[0].due, theirs.until, "sent", now, "")
    [d] = store_deliveries(api)
    assert (d.state, d.attempts) == ("sent", 1)


def test_a_reused_webhook_id_gets_a_new_secret(api: Api) -> None:
    receiver = Receiver()
    try:
        p = Passes(api)
        old = api.ok("POST", "/api/v1/webhooks", json={"url": receiver.url})
        api.ok("DELETE", f"/api/v1/webhooks/{old['id']}")
        new = api.ok("POST", "/api/v1/webhooks", json={"url": receiver.url})
        if api.app.state.db.dialect == "sqlite":
            assert new["id"] == old["id"]  # SQLite hands the deleted newest id out again
        assert new["secret"] != old["secret"]
        node = join(api, "n1", devices=1)
        beat(api, "n1", node, {0: SICK})
        p.run()
        assert [o.ok for o in p.engine.notifier.run_once()] == [True]
        [(headers, body)] = receiver.got
        assert verify(new["secret"], headers, body)
        assert not verify(old["secret"], headers, body)  # the deleted webhook's secret is worthless
    finally:
        receiver.close()


def test_a_webhook_url_s_secrets_stay_out_of_audit_errors_and_logs(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    refusing = Receiver(script=[500])
    try:
        p = Passes(api)
        port = refusing.url.split(":")[2].split("/")[0]
        url = f"http://hookuser:pa55word@127.0.0.1:{port}/services/T0/B0/s3cretpath?token=t0ken"
        hook = api.ok("POST", "/api/v1/webhooks", json={"url": url})
        assert [h["url"] for h in api.ok("GET", "/api/v1/webhooks")["items"]] == [url]  # admins: whole
        node = join(api, "n1", devices=1)
        beat(api, "n1", node, {0: SICK})
        p.run()
        with caplog.at_level(logging.INFO, logger="computepool.server"):
            assert [o.ok for o in p.engine.notifier.run_once()] == [False]
        assert refusing.got  # it did reach the receiver, path and all
        [d] = store_deliveries(api)
        origin = f"http://127.0.0.1:{port}"
        assert (
            "HTTP 500" in d.last_error and origin in d.last_error and f"webhook {hook['id']}" in d.last_error
        )
        api.ok("DELETE", f"/api/v1/webhooks/{hook['id']}")
        audit = api.ok("GET", "/api/v1/audit", params={"target": f"webhook:{hook['id']}"})["items"]
        written = json.dumps(audit) + d.last_error + caplog.text
        assert origin in json.dumps(audit)
        for secret in ("pa55word", "hookuser", "s3cretpath", "t0ken", "/services/"):
            assert secret not in written, secret
    finally:
        refusing.close()
