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
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import JOB_PYTHON, cpool, publish_image, wait_for
from job_node import Node, job_node

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent"),
]

MARK = "the job's own passwd\n"
MIN_SWAPS = 2000
TRIES = 24  # before links were refused about one try in five got a host file: all 24 miss 0.5% of runs

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


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with job_node() as n:
        yield n


def _race(node: Node, tmp_path: Path, **job: Any) -> None:
    tenant, client = node.member("rc")
    r = client.post("/api/v1/allocations", json={"cpu_milli": 500, **job})
    assert r.status_code == 201, r.text + node.logs()
    aid = int(r.json()["id"])
    work = node.agent_dir / "runs" / str(aid) / "1" / "work"
    swaps = work / "swaps"
    try:
        wait_for("the job swapping", lambda: swaps.exists(), 120, node.logs)
        env = node.cli_env(tenant)
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


def test_a_process_job_racing_links_gets_no_host_file_back(node: Node, tmp_path: Path) -> None:
    _race(node, tmp_path, command=[JOB_PYTHON, "-c", SWAP, MARK])


def test_a_container_job_racing_links_gets_no_host_file_back(node: Node, tmp_path: Path, image: str) -> None:
    publish_image(node.admin, image)
    _race(node, tmp_path, command=["python3", "-c", SWAP, MARK], image=image)
