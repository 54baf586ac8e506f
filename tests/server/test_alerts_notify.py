"""Alert notifications: signed webhooks to a real receiver on loopback (retried after failures,
never holding up the rule pass when one hangs), and mail to a real SMTP server (aiosmtpd)."""

from __future__ import annotations

import hashlib
import hmac
import json
import ssl
import stat
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from email import message_from_bytes
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller as SmtpController
from aiosmtpd.handlers import Message as SmtpMessage
from aiosmtpd.smtp import AuthResult
from harness import Api, free_port
from test_alerts import Passes, beat, firing
from test_allocations import join

from computepool.core.tls import generate_self_signed
from computepool.store import alerts as store
from computepool.store.db import db_now

SICK = {"health": "XID 48: double-bit ECC error", "utilization_pct": 10.0}
WELL = {"health": "", "utilization_pct": 10.0}


class Receiver:
    """A webhook receiver: records each POST; answers the statuses in `script` first, then 200;
    with `hang` set, holds every request until the test ends."""

    def __init__(self, script: list[int] | None = None, hang: bool = False) -> None:
        self.script = list(script or [])
        self.got: list[tuple[dict[str, str], bytes]] = []
        self.release = threading.Event()
        self.hang = hang
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                if outer.hang:
                    outer.release.wait(30)
                code = outer.script.pop(0) if outer.script else 200
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(script=[500, 503])
    yield r
    r.close()


def verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """What a receiver does (docs/alerts.md shows the same)."""
    ts = headers["x-computepool-timestamp"]
    want = "sha256=" + hmac.new(secret.encode(), ts.encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(want, headers["x-computepool-signature"]) and abs(time.time() - int(ts)) < 300


def test_signed_webhooks_are_retried_until_delivered(api: Api, receiver: Receiver) -> None:
    p = Passes(api)
    notifier = p.engine.notifier
    key_file = api.settings.webhook_key_path
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600  # made at start, private
    hook = api.ok("POST", "/api/v1/webhooks", json={"url": receiver.url})
    assert len(hook["secret"]) == 64
    listed = api.ok("GET", "/api/v1/webhooks")["items"]
    assert [h["url"] for h in listed] == [receiver.url] and "secret" not in listed[0]
    audit = api.ok("GET", "/api/v1/audit", params={"action": "webhook.create"})["items"]
    assert hook["secret"] not in json.dumps(audit)  # the secret is never recorded
    node = join(api, "n1", devices=1)
    beat(api, "n1", node, {0: SICK})
    assert p.run().fired == [("device-unhealthy", "device/n1/0")]
    # the receiver fails twice: retried with back-off, then delivered
    assert [o.ok for o in notifier.run_once()] == [False]
    assert notifier.run_once() == []  # not due yet (5 s back-off)
    with api.app.state.db.read() as s:
        now = db_now(s)
        [d] = store.deliveries(s)
        assert d.state == "pending" and d.attempts == 1 and "HTTP 500" in d.last_error
    assert [o.ok for o in notifier.run_once(now + timedelta(seconds=6))] == [False]
    assert [o.ok for o in notifier.run_once(now + timedelta(seconds=30))] == [True]
    assert len(receiver.got) == 3
    headers, body = receiver.got[-1]
    assert verify(hook["secret"], headers, body)
    assert not verify("0" * 64, headers, body)  # another secret does not verify
    # every try of one notification carries the same delivery id: a receiver drops repeats by it
    assert {h["x-computepool-delivery"] for h, _ in receiver.got} == {headers["x-computepool-delivery"]}
    doc = json.loads(body)
    assert doc["event"] == "firing"
    assert doc["alert"]["rule"] == "device-unhealthy" and doc["alert"]["subject"] == "device/n1/0"
    assert doc["alert"]["state"] == "firing" and "XID 48" in doc["alert"]["summary"]
    # resolved: one more notification, signed alike
    beat(api, "n1", node, {0: WELL})
    assert p.run().resolved == [("device-unhealthy", "device/n1/0")]
    assert [o.ok for o in notifier.run_once()] == [True]
    headers, body = receiver.got[-1]
    assert verify(hook["secret"], headers, body)
    assert headers["x-computepool-delivery"] != receiver.got[0][0]["x-computepool-delivery"]
    doc = json.loads(body)
    assert doc["event"] == "resolved" and doc["alert"]["state"] == "resolved" and doc["alert"]["resolved_at"]
    with api.app.state.db.read() as s:
        assert [(d.event, d.state, d.attempts) for d in store.deliveries(s)] == [
            ("firing", "sent", 3),
            ("resolved", "sent", 1),
        ]
    # a deleted webhook gets nothing more
    api.ok("DELETE", f"/api/v1/webhooks/{hook['id']}")
    assert api.delete(f"/api/v1/webhooks/{hook['id']}", headers=api.admin).status_code == 404
    assert api.delete("/api/v1/webhooks/99999999999999999999999", headers=api.admin).status_code == 404


def test_bad_webhook_urls_are_refused(api: Api) -> None:
    for url in ("ftp://example.com/x", "not a url", "http://", "javascript:alert(1)", "x" * 3000,
                "http://x:99999/", "http://x:abc/", "http://x:0/"):  # fmt: skip
        r = api.post("/api/v1/webhooks", json={"url": url}, headers=api.admin)
        assert r.status_code == 422 and "url" in r.text, (url, r.text)
    assert (
        api.post("/api/v1/webhooks", json={"url": "http://a/", "x": 1}, headers=api.admin).status_code == 422
    )
    assert api.ok("GET", "/api/v1/webhooks")["items"] == []


def test_a_hanging_webhook_never_holds_up_the_rules(make_api: Any) -> None:
    hanging = Receiver(hang=True)
    try:
        api = make_api(heartbeat_interval_s=0.2, suspect_after_s=30.0, lost_after_s=60.0)
        p = Passes(api)
        notifier = p.engine.notifier
        notifier.deadline_s = 15  # far longer than a pass takes, even on a busy machine
        notifier.auto = True  # its own loop, as in a running server
        api.ok("POST", "/api/v1/webhooks", json={"url": hanging.url})
        node = join(api, "n1", devices=2)
        beat(api, "n1", node, {0: SICK, 1: WELL})
        assert p.run().fired == [("device-unhealthy", "device/n1/0")]
        deadline = time.monotonic() + 5
        while not hanging.got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hanging.got  # the notifier is now waiting on the receiver
        beat(api, "n1", node, {0: SICK, 1: SICK})
        assert p.run().fired == [("device-unhealthy", "device/n1/1")]
        # the pass did not wait for the webhook: the first delivery is still held by the receiver
        with api.app.state.db.read() as s:
            assert [d.attempts for d in store.deliveries(s) if d.attempts > 0] == []
        deadline = time.monotonic() + 60
        errors: list[str] = []
        while time.monotonic() < deadline:
            with api.app.state.db.read() as s:
                errors = [d.last_error for d in store.deliveries(s) if d.attempts > 0]
            if errors:
                break
            time.sleep(0.1)
        assert errors and "Timeout" in errors[0], errors
    finally:
        hanging.close()


class Inbox(SmtpMessage):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[Any] = []

    def handle_message(self, message: Any) -> None:
        self.messages.append(message)


def test_alert_mail_goes_to_a_real_smtp_server(make_api: Any) -> None:
    inbox = Inbox()
    port = free_port()
    smtp = SmtpController(inbox, hostname="127.0.0.1", port=port)
    smtp.start()
    try:
        api = make_api(smtp_host="127.0.0.1", smtp_port=port, mail_from="pool@example.com",
                       mail_to=("ops@example.com", "oncall@example.com"))  # fmt: skip
        p = Passes(api)
        node = join(api, "n1", devices=1)
        beat(api, "n1", node, {0: SICK})
        p.run()
        assert [o.ok for o in p.engine.notifier.run_once()] == [True]
        [msg] = inbox.messages
        assert msg["Subject"] == "[cpool] FIRING critical device-unhealthy device/n1/0"
        assert msg["From"] == "pool@example.com" and "oncall@example.com" in msg["To"]
        text = message_from_bytes(msg.as_bytes()).get_payload()
        assert "XID 48" in str(text) and "rule: device-unhealthy" in str(text)
        beat(api, "n1", node, {0: WELL})
        p.run()
        p.engine.notifier.run_once()
        assert [m["Subject"].split()[1] for m in inbox.messages] == ["FIRING", "RESOLVED"]
        assert firing(api, "device-unhealthy") == []
    finally:
        smtp.stop()


def test_alert_mail_with_a_login_goes_over_implicit_tls(
    make_api: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SMTPS (`smtp_tls`): the login and the message cross TLS from the first byte, the server's
    certificate checked against the trusted CAs (here: the test's own, via SSL_CERT_FILE)."""
    cert, key = tmp_path / "smtp.crt", tmp_path / "smtp.key"
    generate_self_signed(cert, key, ["127.0.0.1"])
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    logins: list[tuple[str, str]] = []

    def authenticator(server: Any, session: Any, envelope: Any, mechanism: str, data: Any) -> AuthResult:
        logins.append((data.login.decode(), data.password.decode()))
        return AuthResult(success=data.password == b"hunter2")

    password = tmp_path / "smtp-password"
    password.write_text("hunter2\n")
    inbox, port = Inbox(), free_port()
    smtp = SmtpController(inbox, hostname="127.0.0.1", port=port, ssl_context=server_tls,
                          authenticator=authenticator, auth_require_tls=False)  # fmt: skip
    smtp.start()
    try:
        api = make_api(smtp_host="127.0.0.1", smtp_port=port, smtp_tls=True, smtp_user="pool",
                       smtp_password_file=password, mail_to=("ops@example.com",))  # fmt: skip
        p = Passes(api)
        node = join(api, "n1", devices=1)
        beat(api, "n1", node, {0: SICK})
        p.run()
        assert [o.ok for o in p.engine.notifier.run_once()] == [True]
        assert logins == [("pool", "hunter2")]
        [msg] = inbox.messages
        assert msg["Subject"] == "[cpool] FIRING critical device-unhealthy device/n1/0"
    finally:
        smtp.stop()
