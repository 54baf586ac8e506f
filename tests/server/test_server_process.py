"""The real `cpool server` as a process on loopback: admin token file, HTTP, restart loses nothing."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from harness import free_port

import computepool


def _cpool() -> list[str]:
    exe = shutil.which("cpool", path=str(Path(sys.executable).parent)) or shutil.which("cpool")
    return [exe] if exe else [sys.executable, "-m", "computepool.cli.main"]


def start_server_process(
    data_dir: Path, db_url: str | None, log: Path, *extra: str
) -> tuple[subprocess.Popen[bytes], str]:
    """`cpool server` on a free loopback port, ready; without `db_url`, SQLite in `data_dir`."""
    port = free_port()
    cmd = [*_cpool(), "server", "--data-dir", str(data_dir), "--port", str(port), *extra]
    if db_url:
        cmd += ["--db", db_url]
    # the child runs the same code as the tests, whatever the environment's install points at
    src = str(Path(computepool.__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, f"server exited early:\n{log.read_text()}"
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"server did not become ready:\n{log.read_text()}"
        time.sleep(0.1)


def stop_server_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def running_server(data_dir: Path, db_url: str | None, log: Path) -> Iterator[str]:
    proc, base = start_server_process(data_dir, db_url, log)
    try:
        yield base
    finally:
        stop_server_process(proc)


def test_real_server_restart_keeps_everything(backend: str, db_url: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "home"
    url = None if backend == "sqlite" else db_url
    log = tmp_path / "server.log"
    with running_server(data_dir, url, log) as base:
        token_file = data_dir / "admin-token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        admin = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=base, headers=admin, timeout=10) as c:
            assert c.post("/api/v1/tenants", json={"name": "acme", "weight": 3}).status_code == 201
            assert c.post(
                "/api/v1/users", json={"name": "bob", "tenant": "acme", "role": "member"}
            ).is_success
            bob = c.post("/api/v1/tokens", json={"user": "bob"}).json()["token"]
            quota = {"gpu_milli": {"guaranteed": 2000, "limit": 8000}}
            assert c.put("/api/v1/tenants/acme/quota", json=quota).is_success
            assert httpx.get(f"{base}/api/v1/whoami", timeout=5).status_code == 401
    logged = log.read_text()
    assert str(token_file) in logged and token.split(".")[1] not in logged

    with running_server(data_dir, url, log) as base:
        assert token_file.read_text().strip() == token  # not replaced on restart
        with httpx.Client(base_url=base, headers=admin, timeout=10) as c:
            tenant = c.get("/api/v1/tenants/acme").json()
            assert tenant["weight"] == 3
            assert c.get("/api/v1/tenants/acme/quota").json()["gpu_milli"] == quota["gpu_milli"]
            intact = {"ok": True, "records": 5, "first_broken": None, "cause": None}
            assert c.get("/api/v1/audit/verify").json() == intact
        me = httpx.get(f"{base}/api/v1/whoami", headers={"Authorization": f"Bearer {bob}"}, timeout=5)
        assert me.json()["name"] == "bob" and me.json()["tenant"] == "acme"
    assert "Traceback" not in log.read_text()
    if url is None:
        assert (data_dir / "pool.db").exists()
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
