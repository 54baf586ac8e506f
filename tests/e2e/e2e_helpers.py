"""End-to-end helpers: real `cpool up` / `cpool server` / `cpool agent` processes on loopback."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

import computepool
from computepool.client.images import local_image_id
from computepool.core.tls import client_context

SRC = Path(computepool.__file__).parent.parent


def _job_python() -> str:
    """A python3 a tenant's user may run (this interpreter may live in a home only root can enter)."""
    path = Path(sys.executable)
    if all(os.stat(d).st_mode & 0o001 for d in path.parents):
        return sys.executable
    return shutil.which("python3", path="/usr/bin:/bin") or sys.executable


JOB_PYTHON = _job_python()


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
    env.pop("CPOOL_CA", None)
    if "CPOOL_CONFIG" not in os.environ:  # `cpool up` saves its login: never into the host's ~/.config
        env["CPOOL_CONFIG"] = str(Path(tempfile.gettempdir(), f"cpool-cfg-{uuid.uuid4().hex}", "config.json"))
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


def job_readable_dir() -> Path:
    """A world-readable folder a tenant's job sees as the host's: a job's sandbox has a /tmp and a
    /var/tmp of its own, so a file the test writes there does not exist for the job."""
    folder = Path("/var/cache") / "cpool-test-files"
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(folder, 0o755)
    return folder


def job_readable_copy(src: Path) -> Path:
    """A copy of `src` that a tenant's job can read (in `job_readable_dir`). Named by the file's
    hash, written once (atomically), world-readable."""
    data = src.read_bytes()
    folder = job_readable_dir()
    dst = folder / f"{hashlib.sha256(data).hexdigest()[:16]}-{src.name}"
    if not dst.exists():
        part = folder / f".{dst.name}.{os.getpid()}"
        part.write_bytes(data)
        os.chmod(part, 0o644)
        part.replace(dst)
    return dst


def kill_jobs_under(root: Path) -> int:
    """SIGKILL whatever still runs from `root` (job supervisors and sandbox inits whose command line
    names it): an agent stopped at a test's end leaves its jobs running, as it should in a real pool,
    and a replica left behind would hold its port for the next test. Killing a job's sandbox init
    ends everything in its PID namespace. Returns how many processes were killed."""
    mine, killed = str(root), 0
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid != os.getpid() and any(mine in arg for arg in proc.info["cmdline"] or ()):
                proc.kill()
                killed += 1
        except psutil.Error:
            continue
    return killed + _remove_containers_under(mine)


def _remove_containers_under(mine: str) -> int:
    """Containers of the pool's agents whose mounts come from `mine` (a container job's work dir):
    conmon keeps them running after their agent and supervisor are gone."""
    podman = shutil.which("podman")
    if podman is None:
        return 0
    ids = subprocess.run(
        [podman, "ps", "-aq", "--filter", "label=computepool.agent"], capture_output=True, text=True
    ).stdout.split()
    gone = 0
    for cid in ids:
        mounts = subprocess.run(
            [podman, "inspect", "--format", "{{range .Mounts}}{{.Source}} {{end}}", cid],
            capture_output=True,
            text=True,
        ).stdout
        if mine in mounts:
            subprocess.run([podman, "rm", "-f", "-t", "0", cid], capture_output=True)
            gone += 1
    return gone


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Pool:
    """The API of a running control plane, as the admin; over https it trusts `cpool up`'s certificate
    (DATA_DIR/tls/cert.pem) unless given another CA."""

    def __init__(self, url: str, data_dir: Path, ca: Path | None = None) -> None:
        self.url = url
        token = (data_dir / "admin-token").read_text().strip()
        if ca is None and url.startswith("https://"):
            ca = data_dir / "tls" / "cert.pem"
        self.verify = client_context(ca)
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10, verify=self.verify
        )

    def ready(self) -> bool:
        return httpx.get(f"{self.url}/readyz", timeout=2, verify=self.verify).status_code == 200

    def job(self, code: str, **kw: Any) -> int:
        body = {"command": [JOB_PYTHON, "-c", code], **kw}
        r = self.http.post("/api/v1/allocations", json=body)
        assert r.status_code == 201, r.text
        return int(r.json()["id"])

    def get(self, alloc_id: int) -> dict[str, Any]:
        r = self.http.get(f"/api/v1/allocations/{alloc_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def state(self, alloc_id: int) -> str:
        return str(self.get(alloc_id)["state"])

    def logs(self, alloc_id: int, stream: str = "stdout") -> str:
        """The job's stdout (or stderr) so far: the API keeps the two apart, with an offset each."""
        r = self.http.get(f"/api/v1/allocations/{alloc_id}/logs")
        assert r.status_code == 200, r.text
        return str(r.json()[stream]["data"])

    def nodes(self) -> list[dict[str, Any]]:
        return list(self.http.get("/api/v1/nodes").json()["items"])

    def close(self) -> None:
        self.http.close()


def publish_image(admin: httpx.Client, image: str, tenants: list[str] | None = None) -> str:
    """Publish `image`, pinned to the id this host's podman has for it, on a pool as its admin (a
    tenant's container job may run only what was published to it); returns the id."""
    found = local_image_id(image)
    assert found is not None, f"podman here has no image {image}"
    r = admin.post("/api/v1/images", json={"name": image, "digest": found, "tenants": tenants})
    assert r.status_code == 200, r.text
    return found


def sleeper(seconds: float, marker: str = "") -> str:
    """A job that writes its pid into its run dir (so the test can watch it), sleeps, prints, exits 0."""
    return (
        "import os, time\n"
        "open(os.path.join(os.environ['CPOOL_RUN_DIR'], 'job.pid'), 'w').write(str(os.getpid()))\n"
        f"time.sleep({seconds})\n"
        f"print({marker!r}, flush=True)\n"
    )


def job_pid(agent_dir: Path, alloc_id: int, attempt: int = 1) -> int:
    """The job's pid on the host. A sandboxed job writes into `work/` the pid it has in its own PID
    namespace: the host's is the process whose NSpid ends with it and whose cwd is that dir."""
    run = agent_dir / "runs" / str(alloc_id) / str(attempt)
    work = run / "work"
    if not work.is_dir():
        return int((run / "job.pid").read_text().strip())
    inner = int((work / "job.pid").read_text().strip())
    for p in psutil.process_iter():
        try:
            status = Path(f"/proc/{p.pid}/status").read_text()
            nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
            if len(nspid) > 1 and int(nspid[-1]) == inner and p.cwd() == str(work):
                return p.pid
        except (OSError, StopIteration, psutil.Error):
            continue
    raise ProcessLookupError(f"no process of job {alloc_id}#{attempt} with pid {inner} in its namespace")


@contextlib.contextmanager
def local_pool(
    tmp: Path, simulate: str = "1xA100-80GB", extra: tuple[str, ...] = ()
) -> Iterator[tuple[dict[str, str], Pool]]:
    """`cpool up` on a free port (`extra`: more of its options): the environment a `cpool` client
    needs to use it, and its API."""
    data, port, log = tmp / "pool", free_port(), tmp / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cpool("up", "--simulate", simulate, "--data-dir", str(data), "--port", str(port), *extra),
            stdout=out, stderr=subprocess.STDOUT, env=child_env(),
        )  # fmt: skip
    try:
        wait_for("cpool up", lambda: "ComputePool is up" in log.read_text(), 60, log.read_text)
        pool = Pool(f"https://127.0.0.1:{port}", data)
        wait_for("the local node", lambda: [n["state"] for n in pool.nodes()] == ["ready"], 30)
        env = child_env()
        env["CPOOL_SERVER"] = f"https://127.0.0.1:{port}"
        env["CPOOL_CA"] = str(data / "tls" / "cert.pem")
        env["CPOOL_TOKEN"] = (data / "admin-token").read_text().strip()
        try:
            yield env, pool
        finally:
            pool.close()
    finally:
        stop(proc, signal.SIGINT, timeout=40)
        kill_jobs_under(data)


@contextlib.contextmanager
def simulated_up(tmp: Path, spec: str) -> Iterator[tuple[Pool, dict[str, str]]]:
    """`cpool up --simulate SPEC` in `tmp`, its node ready: the pool and a CLI environment for it."""
    data, port, log = tmp / "pool", free_port(), tmp / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cpool("up", "--simulate", spec, "--data-dir", str(data), "--port", str(port)),
            stdout=out, stderr=subprocess.STDOUT, env=child_env(),
        )  # fmt: skip
    try:
        up = wait_for(
            "cpool up", lambda: re.search(r"ComputePool is up: API (\S+)", log.read_text()), 60, log.read_text
        )
        p = Pool(up[1], data)
        wait_for("the local node", lambda: [n["state"] for n in p.nodes()] == ["ready"], 30)
        env = child_env()
        env["CPOOL_SERVER"] = up[1]
        if up[1].startswith("https://"):
            env["CPOOL_CA"] = str(data / "tls" / "cert.pem")
        env["CPOOL_TOKEN"] = (data / "admin-token").read_text().strip()
        yield p, env
        p.close()
    finally:
        stop(proc, signal.SIGINT, timeout=40)
