"""`cpool cp` against a job that swaps a directory and a link to `/` while its node packs the path.

The job keeps a directory `d` (holding its own `d/etc/passwd`) and a link `l` -> `/`, and exchanges
the two names atomically (renameat2 RENAME_EXCHANGE) in a loop, so that `d` is now its directory,
now a link to the host's root. A user of the tenant asks for `d/etc/passwd` and `d/etc` over and
over: every answer must be the job's own file or an error, never a file of the host. Once from a
process job, once from a container job (which sees its work dir at /work: its `/` is the image's,
but the link means the host's `/` to whoever follows it outside).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import JOB_PYTHON, child_env, cpool, free_port, kill_jobs_under, stop, wait_for

from computepool.agent.container import Podman
from computepool.agent.tenants import remove_tenant_user

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent"),
]

MARK = "the job's own passwd\n"
MIN_SWAPS = 2000
TRIES = 48  # on a busy host, about one try in five got a host file before links were refused

SWAP = r"""
import ctypes, os, platform, sys, time
os.makedirs("d/etc", exist_ok=True)
open("d/etc/passwd", "w").write(sys.argv[1])
os.symlink("/", "l")
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
if hasattr(libc, "renameat2"):
    def exchange():
        return libc.renameat2(AT_FDCWD, b"d", AT_FDCWD, b"l", RENAME_EXCHANGE)
else:  # an older libc: the system call itself
    nr = {"x86_64": 316, "aarch64": 276}[platform.machine()]
    def exchange():
        return libc.syscall(nr, AT_FDCWD, b"d", AT_FDCWD, b"l", RENAME_EXCHANGE)
worker = os.fork()  # two swapping: one of them is on a CPU more often on a busy host
n, end = 0, time.monotonic() + 600
while time.monotonic() < end:
    if exchange() != 0:
        raise SystemExit(f"renameat2: {os.strerror(ctypes.get_errno())}")
    n += 1
    if n % 500 == 0 and worker:
        with open("swaps.tmp", "w") as f:
            f.write(str(n))
        os.replace("swaps.tmp", "swaps")
"""


class Node:
    """`cpool server` and a root `cpool agent` (podman for container jobs), data dirs under /var/tmp."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.srv_dir, self.agent_dir = root / "srv", root / "agent"
        self.env = child_env()
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        with (self.root / "server.log").open("ab") as out:
            self.procs.append(subprocess.Popen(
                cpool("server", "--data-dir", str(self.srv_dir), "--port", str(self.port)),
                stdout=out, stderr=subprocess.STDOUT, env=self.env,
            ))  # fmt: skip
        wait_for("the server", lambda: httpx.get(f"{self.url}/readyz").is_success, 60, self.logs)
        token = (self.srv_dir / "admin-token").read_text().strip()
        self.admin = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        join = self.admin.post("/api/v1/join-tokens", json={}).json()["token"]
        with (self.root / "agent.log").open("ab") as out:
            self.procs.append(subprocess.Popen(
                cpool("agent", "--server", self.url, "--join-token", join, "--data-dir", str(self.agent_dir),
                      "--name", "racy", "--kill-grace-s", "1"),
                stdout=out, stderr=subprocess.STDOUT, env=self.env,
            ))  # fmt: skip
        wait_for("the node", lambda: [n["state"] for n in self.admin.get("/api/v1/nodes").json()["items"]]
                 == ["ready"], 60, self.logs)  # fmt: skip

    def logs(self) -> str:
        files = [self.root / f for f in ("server.log", "agent.log")]
        return "\n".join(f.read_text()[-4000:] for f in files if f.exists())

    def member(self, tenant: str) -> tuple[httpx.Client, str]:
        assert self.admin.post("/api/v1/tenants", json={"name": tenant}).status_code == 201
        user = f"m-{tenant}"
        r = self.admin.post("/api/v1/users", json={"name": user, "tenant": tenant, "role": "member"})
        assert r.status_code == 201, r.text
        r = self.admin.post("/api/v1/tokens", json={"user": user})
        assert r.status_code == 201, r.text
        token = str(r.json()["token"])
        client = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        return client, token

    def publish(self, image: str) -> None:
        """Publish `image` to every tenant where the pool admits only published images."""
        digest = subprocess.run(
            ["podman", "image", "inspect", "--format", "{{.Id}}", image],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        r = self.admin.post("/api/v1/images", json={"name": image, "digest": f"sha256:{digest}"})
        assert r.status_code in (200, 201, 404), r.text  # 404: this pool runs any local image

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)
        kill_jobs_under(self.root)


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    root = Path("/var/tmp") / f"cpool-race-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o755)
    n = Node(root)
    try:
        n.start()
        yield n
    finally:
        n.close()
        podman = Podman(n.agent_dir)
        if shutil.which("podman"):
            for key in podman.all_keys():
                podman.remove(key)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def tenant(node: Node) -> Iterator[str]:
    name = f"rc{uuid.uuid4().hex[:6]}"
    yield name
    remove_tenant_user(name)


def _race(node: Node, tenant: str, tmp_path: Path, **job: Any) -> None:
    client, token = node.member(tenant)
    r = client.post("/api/v1/allocations", json={"cpu_milli": 500, **job})
    assert r.status_code == 201, r.text + node.logs()
    aid = int(r.json()["id"])
    work = node.agent_dir / "runs" / str(aid) / "1" / "work"
    swaps = work / "swaps"
    try:
        wait_for("the job swapping", lambda: swaps.exists(), 120, node.logs)
        env = {**node.env, "CPOOL_SERVER": node.url, "CPOOL_TOKEN": token}
        results: list[str] = []
        for i in range(TRIES):
            path = "d/etc" if i % 4 == 3 else "d/etc/passwd"
            dest = tmp_path / f"try{i}"
            dest.mkdir()
            done = subprocess.run(
                cpool("cp", f"{aid}:{path}", str(dest)), env=env, capture_output=True, text=True, timeout=180
            )
            got = dest / "passwd" if path.endswith("passwd") else dest / "etc" / "passwd"
            if done.returncode != 0:
                results.append(f"error: {done.stderr.strip()[-200:]}")
            elif got.is_file() and not got.is_symlink():
                text = got.read_text(errors="replace")
                assert text == MARK, f"try {i} ({path}) brought back a file of the host:\n{text[:300]}"
                results.append("own")
            else:
                results.append(f"nothing: {sorted(p.name for p in dest.rglob('*'))}")
        assert int(swaps.read_text()) >= MIN_SWAPS, "the job did not race long enough"
        assert "own" in results, results  # the request works at all: not every answer an error
    finally:
        client.post(f"/api/v1/allocations/{aid}/cancel")


def test_a_process_job_racing_links_gets_no_host_file_back(node: Node, tenant: str, tmp_path: Path) -> None:
    _race(node, tenant, tmp_path, command=[JOB_PYTHON, "-c", SWAP, MARK])


def test_a_container_job_racing_links_gets_no_host_file_back(
    node: Node, tenant: str, tmp_path: Path, image: str
) -> None:
    node.publish(image)
    _race(node, tenant, tmp_path, command=["python3", "-c", SWAP, MARK], image=image)
