"""`cpool alerts` against a real `cpool server` started with short alert intervals: a node that
stops heartbeating fires node-suspect then node-lost in the server's own loop, a webhook added
from the CLI gets them signed, rules are retuned, and bad input is one line."""

from __future__ import annotations

import hashlib
import hmac
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread
from typing import Any

import httpx
import pytest
from poolkit import Cli, PoolServer, child_env, one_error_line

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from harness import free_port  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolServer]:
    """`cpool server` judging heartbeats in seconds and running the rules twice a second."""
    root = tmp_path_factory.mktemp("pool")
    data_dir, log = root / "data", root / "server.log"
    url = f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "computepool.cli.main", "server", "--data-dir", str(data_dir)]
    cmd += ["--port", url.rsplit(":", 1)[1], "--log-level", "warning", "--heartbeat-s", "0.2"]
    cmd += ["--suspect-s", "1", "--lost-s", "2.5", "--alerts-interval", "0.3", "--ledger-interval", "5"]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env())
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"server exited early:\n{log.read_text()}"
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"server did not become ready:\n{log.read_text()}"
            time.sleep(0.1)
        yield PoolServer(url, (data_dir / "admin-token").read_text().strip(), data_dir, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text(), log.read_text()


class Receiver:
    def __init__(self) -> None:
        self.got: list[tuple[dict[str, str], bytes]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        Thread(target=self.server.serve_forever, daemon=True).start()


def join(server: PoolServer, name: str) -> None:
    admin = {"Authorization": f"Bearer {server.token}"}
    token = httpx.post(f"{server.url}/api/v1/join-tokens", json={}, headers=admin).json()["token"]
    body = {"join_token": token, "name": name, "cpu_milli": 4000, "memory_mib": 8192, "labels": {},
            "devices": [{"index": 0, "vendor": "simulated", "model": "T4", "memory_mib": 15360,
                         "uuid": f"GPU-{name}-0"}]}  # fmt: skip
    r = httpx.post(f"{server.url}/api/v1/nodes/join", json=body)
    assert r.status_code < 300, r.text


def wait_for(cli: Cli, rule: str, state: str, timeout: float = 60.0) -> dict[str, Any]:
    """The first alert of `rule` in `state` ("any": fired, whether it is still firing or not)."""
    deadline = time.monotonic() + timeout
    while True:
        r = cli("alerts", "--json")
        assert r.exit_code == 0, r.output
        hits = [a for a in json.loads(r.stdout) if a["rule"] == rule and state in (a["state"], "any")]
        if hits:
            return dict(hits[0])
        assert time.monotonic() < deadline, f"no {state} {rule} alert: {r.stdout}"
        time.sleep(0.2)


def test_rules_are_listed_and_retuned(cli: Cli) -> None:
    r = cli("alerts", "rules", "--json")
    assert r.exit_code == 0, r.output
    names = [x["name"] for x in json.loads(r.stdout)]
    assert len(names) == 11
    assert {"node-lost", "nodes-silent", "fragmentation", "audit-chain-broken"} <= set(names)
    r = cli("alerts", "rules")
    assert r.exit_code == 0 and "idle-devices" in r.stdout and "30m" in r.stdout
    r = cli("alerts", "rule", "idle-devices", "--threshold", "5", "--for", "10m")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "rule idle-devices: enabled, threshold 5 %, for 10m"
    r = cli("alerts", "rule", "idle-devices", "--disable", "--json")
    out = json.loads(r.stdout)
    assert out["enabled"] is False and out["duration_s"] == 600 and out["threshold"] == 5
    assert "no-such" in one_error_line(cli("alerts", "rule", "no-such", "--disable"))
    assert "--threshold" in one_error_line(cli("alerts", "rule", "node-lost", "--threshold", "-1"))
    for odd in ("nan", "inf"):
        assert "--threshold" in one_error_line(cli("alerts", "rule", "node-lost", "--threshold", odd))
    assert "--for" in one_error_line(cli("alerts", "rule", "node-lost", "--for", "soon"))
    assert "nothing to change" in one_error_line(cli("alerts", "rule", "node-lost"))
    assert "--firing" in one_error_line(cli("alerts", "--firing", "--all"))
    assert "since" in one_error_line(cli("alerts", "--since", "whenever"))


def test_a_silent_node_fires_alerts_that_reach_a_webhook_signed(cli: Cli, server: PoolServer) -> None:
    receiver = Receiver()
    try:
        assert "url" in one_error_line(cli("alerts", "webhook", "add", "ftp://example.com/"))
        assert "port" in one_error_line(cli("alerts", "webhook", "add", "http://example.com:99999/"))
        r = cli("alerts", "webhook", "add", receiver.url, "--json")
        assert r.exit_code == 0, r.output
        hook = json.loads(r.stdout)
        r = cli("alerts", "webhook", "list")
        assert r.exit_code == 0 and receiver.url in r.stdout and hook["secret"] not in r.stdout
        join(server, "quiet")  # it never heartbeats again
        suspect = wait_for(cli, "node-suspect", "any")  # a busy host may see it resolved (lost) first
        assert suspect["subject"] == "node/quiet" and suspect["severity"] == "warning"
        wait_for(cli, "node-lost", "firing")
        wait_for(cli, "node-suspect", "resolved")
        r = cli("alerts", "--firing")
        assert r.exit_code == 0 and "node-lost" in r.stdout and "node/quiet" in r.stdout
        assert "node-suspect" not in r.stdout
        deadline = time.monotonic() + 60
        while len(receiver.got) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        events = []
        deliveries = [headers["x-computepool-delivery"] for headers, _ in receiver.got]
        assert all(x.isdigit() for x in deliveries) and len(set(deliveries)) == len(deliveries)
        for headers, body in receiver.got:
            ts = headers["x-computepool-timestamp"]
            mac = hmac.new(hook["secret"].encode(), ts.encode() + b"." + body, hashlib.sha256).hexdigest()
            assert headers["x-computepool-signature"] == f"sha256={mac}"
            doc = json.loads(body)
            events.append((doc["event"], doc["alert"]["rule"]))
        assert ("firing", "node-suspect") in events and ("firing", "node-lost") in events
        assert ("resolved", "node-suspect") in events
        r = cli("alerts", "webhook", "delete", str(hook["id"]))
        assert r.exit_code == 0 and "deleted" in r.stdout
        assert "not found" in one_error_line(cli("alerts", "webhook", "delete", str(hook["id"])))
    finally:
        receiver.server.shutdown()


def test_server_refuses_bad_mail_flags(cli: Cli, tmp_path: Path) -> None:
    d = str(tmp_path / "d")
    line = one_error_line(cli("server", "--data-dir", d, "--mail-to", "ops@example.com"))
    assert "--smtp-host" in line
    line = one_error_line(cli("server", "--data-dir", d, "--smtp-host", "mx", "--mail-to", "nobody"))
    assert "nobody" in line
    line = one_error_line(cli("server", "--data-dir", d, "--smtp-host", "mx", "--smtp-user", "u"))
    assert "--smtp-user needs --smtp-starttls or --smtp-tls" in line  # no password in the clear
    mx = ("server", "--data-dir", d, "--smtp-host", "mx", "--smtp-user", "u")
    assert "--smtp-password-file" in one_error_line(cli(*mx, "--smtp-starttls"))
    assert "--smtp-password-file" in one_error_line(cli(*mx, "--smtp-tls", "--smtp-port", "465"))
    assert "give one of them" in one_error_line(cli(*mx, "--smtp-tls", "--smtp-starttls"))
    assert "alerts_interval" in one_error_line(cli("server", "--data-dir", d, "--alerts-interval", "0"))
