"""Failures are one readable line and a non-zero exit; the client resolves config and retries 503s."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import free_port
from poolkit import Cli, PoolServer, child_env, one_error_line, start_server

from computepool.client import PoolClient, PoolError, ServerUnreachable, resolve_config, save_config
from computepool.client.config import ClientConfig


def test_unreachable_wrong_token_unknown_tenant_bad_quantities(cli: Cli) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    line = one_error_line(cli("tenants", "list", env={"CPOOL_SERVER": down}))
    assert "cannot reach the pool server" in line and down in line
    assert "401" in one_error_line(cli("users", "list", env={"CPOOL_TOKEN": "0123456789abcdef.nope"}))
    assert "401" in one_error_line(cli("users", "list", env={"CPOOL_TOKEN": None}))
    assert "nope" in one_error_line(cli("quota", "get", "nope"))
    assert "nope" in one_error_line(cli("users", "create", "x1", "--tenant", "nope", "--role", "member"))
    assert "--gpus" in one_error_line(cli("alloc", "--gpus", "1.5"))
    assert "--mem" in one_error_line(cli("quota", "set", "default", "--mem", "10XB"))
    assert "--cpus" in one_error_line(cli("alloc", "--cpus", "two"))
    assert "--expires" in one_error_line(cli("tokens", "create", "--expires", "soon"))
    assert "--role" in one_error_line(cli("users", "create", "x2", "--tenant", "default", "--role", "boss"))
    assert "limit" in one_error_line(cli("quota", "set", "default", "--gpus", "2", "--gpus-limit", "1"))
    assert "--isolation" in one_error_line(cli("alloc", "--gpus", "1", "--isolation", "magic"))


def test_a_real_process_prints_no_traceback(tmp_path: Path) -> None:
    env = child_env(CPOOL_SERVER=f"http://127.0.0.1:{free_port()}", CPOOL_CONFIG=str(tmp_path / "c.json"))
    cmd = [sys.executable, "-m", "computepool.cli.main", "tenants", "list"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "cannot reach" in p.stderr and "Traceback" not in p.stderr


def test_login_refuses_a_bad_token_and_writes_nothing(cli: Cli, tmp_path: Path) -> None:
    line = one_error_line(cli("login", "--token", "0123456789abcdef.nope", env={"CPOOL_TOKEN": None}))
    assert "401" in line and not (tmp_path / "config.json").exists()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert "empty" in one_error_line(cli("login", "--token-file", str(empty)))


def test_config_precedence_flags_env_file(tmp_path: Path) -> None:
    env = {"CPOOL_CONFIG": str(tmp_path / "cfg" / "config.json")}
    assert resolve_config(env=env) == ClientConfig("http://127.0.0.1:8470", None)
    path = save_config(ClientConfig("http://file:1", "file.tok"), env)
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert resolve_config(env=env) == ClientConfig("http://file:1", "file.tok")
    env |= {"CPOOL_SERVER": "env:2", "CPOOL_TOKEN": "env.tok"}
    assert resolve_config(env=env) == ClientConfig("http://env:2", "env.tok")
    assert resolve_config("https://flag:3/", "flag.tok", env) == ClientConfig("https://flag:3", "flag.tok")
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_config(env={"CPOOL_CONFIG": str(path)})


class _Flaky(http.server.BaseHTTPRequestHandler):
    """Answers 503 (or the server's `code`) + Retry-After a set number of times, then 200: the
    server's database outage, or a tenant over its API rate (429)."""

    def do_GET(self) -> None:
        left: list[int] = self.server.left  # type: ignore[attr-defined]
        body: dict[str, object]
        if left[0] > 0:
            left[0] -= 1
            body, status = {"error": "database unavailable, retry later"}, left[1]
        else:
            body, status = (
                {"name": "admin", "role": "admin", "tenant": None, "node": None, "token_id": "x"},
                200,
            )
        data = json.dumps(body).encode()
        self.send_response(status)
        if status != 200:
            self.send_header("Retry-After", "1")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def flaky() -> Iterator[tuple[str, list[int]]]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    srv.left = [0, 503]  # type: ignore[attr-defined]  # answers left to refuse, and with which status
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", srv.left  # type: ignore[attr-defined]
    srv.shutdown()
    srv.server_close()


def test_503_is_retried_as_retry_after_says_then_given_up(flaky: tuple[str, list[int]]) -> None:
    url, left = flaky
    waits: list[float] = []
    left[0] = 2
    with PoolClient(url, "t.t", retries=3, sleep=waits.append) as pool:
        assert pool.whoami()["name"] == "admin"
    assert waits == [1.0, 1.0]
    left[0], waits[:] = 5, []
    with PoolClient(url, "t.t", retries=2, sleep=waits.append) as pool, pytest.raises(PoolError) as e:
        pool.whoami()
    assert e.value.status == 503 and "database" in e.value.message and len(waits) == 2


def test_429_is_retried_as_retry_after_says(flaky: tuple[str, list[int]]) -> None:
    url, left = flaky
    waits: list[float] = []
    left[:] = [2, 429]  # over the tenant's API rate twice: nothing was done, so it is sent again
    with PoolClient(url, "t.t", retries=3, sleep=waits.append) as pool:
        assert pool.whoami()["name"] == "admin"
    assert waits == [1.0, 1.0]


def test_server_unreachable_and_error_fields(server: PoolServer) -> None:
    with pytest.raises(ServerUnreachable, match="cannot reach"):
        PoolClient(f"http://127.0.0.1:{free_port()}", "x.y").whoami()
    with PoolClient(server.url, server.token) as pool, pytest.raises(PoolError) as e:
        pool.create_tenant("Bad Name")
    assert e.value.status == 422 and e.value.field == "name"


def test_audit_verify_names_the_first_broken_record(cli: Cli, tmp_path: Path) -> None:
    """Edit a stored record behind the server's back: verify fails and says which one."""
    import sqlite3

    with start_server(tmp_path) as s:
        env = {"CPOOL_SERVER": s.url, "CPOOL_TOKEN": s.token}
        for name in ("t1", "t2", "t3"):
            assert cli("tenants", "create", name, env=env).exit_code == 0
        with sqlite3.connect(s.data_dir / "pool.db") as db:
            db.execute("UPDATE audit_records SET target = 'tenant:forged' WHERE seq = 2")
        line = one_error_line(cli("audit", "verify", env=env))
        assert "broken at record 2" in line
        assert json.loads(cli("audit", "verify", "--json", env=env).stdout)["first_broken"] == 2
