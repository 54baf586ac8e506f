"""End-to-end helpers: real `cpool up` / `cpool server` / `cpool agent` processes on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

import computepool

SRC = Path(computepool.__file__).parent.parent
HAVE_ALLOCATIONS = (SRC / "computepool" / "server" / "routers" / "allocations.py").exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env() -> dict[str, str]:
    """Children run this checkout's code and never touch the host's cgroups."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    env["CPOOL_CGROUP_BASE"] = "none"
    for k in ("CPOOL_JOIN_TOKEN", "CPOOL_DATA_DIR", "CPOOL_AGENT_DIR", "CPOOL_SERVER", "CPOOL_TOKEN"):
        env.pop(k, None)
    return env


def cpool(*args: str) -> list[str]:
    return [sys.executable, "-m", "computepool.cli.main", *args]


def wait_for(
    what: str, check: Callable[[], Any], timeout: float = 30.0, detail: Callable[[], str] | None = None
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except (httpx.HTTPError, KeyError, OSError, psutil.Error):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f"\n{detail()}" if detail else ""))
        time.sleep(0.1)


def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 20) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Pool:
    """The API of a running control plane, as the admin."""

    def __init__(self, url: str, data_dir: Path) -> None:
        self.url = url
        token = (data_dir / "admin-token").read_text().strip()
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10)

    def ready(self) -> bool:
        return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200

    def job(self, code: str, **kw: Any) -> int:
        body = {"command": [sys.executable, "-c", code], **kw}
        r = self.http.post("/api/v1/allocations", json=body)
        assert r.status_code == 201, r.text
        return int(r.json()["id"])

    def get(self, alloc_id: int) -> dict[str, Any]:
        r = self.http.get(f"/api/v1/allocations/{alloc_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def state(self, alloc_id: int) -> str:
        return str(self.get(alloc_id)["state"])

    def logs(self, alloc_id: int) -> str:
        r = self.http.get(f"/api/v1/allocations/{alloc_id}/logs", params={"offset": 0})
        assert r.status_code == 200, r.text
        return str(r.json()["data"])

    def nodes(self) -> list[dict[str, Any]]:
        return list(self.http.get("/api/v1/nodes").json()["items"])

    def close(self) -> None:
        self.http.close()


def sleeper(seconds: float, marker: str = "") -> str:
    """A job that writes its pid into its run dir (so the test can watch it), sleeps, prints, exits 0."""
    return (
        "import os, time\n"
        "open(os.path.join(os.environ['CPOOL_RUN_DIR'], 'job.pid'), 'w').write(str(os.getpid()))\n"
        f"time.sleep({seconds})\n"
        f"print({marker!r}, flush=True)\n"
    )


def job_pid(agent_dir: Path, alloc_id: int, attempt: int = 1) -> int:
    text = (agent_dir / "runs" / str(alloc_id) / str(attempt) / "job.pid").read_text().strip()
    return int(text)
