"""A job that asks for nothing, for real: a server and a root agent on loopback, tenant users, cgroups.

A tenant once sent jobs without `--cpus` or `--mem`: they ran with no memory limit and no CPU
quota while nothing was booked (thirty at once on a two-core node, one of them holding 3 GiB), with
8192 processes each and an unsized private /tmp and /dev/shm. Now such a request gets its tenant's
defaults (else the pool's) at admission, booked and enforced like any other; the tenant's process
limit holds each job; /tmp and /dev/shm hold half the job's memory each, and count in it.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import JOB_PYTHON, cpool, publish_image, wait_for
from job_node import ENDED, Node, job_node

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and cgroups need a root agent")]

IMAGE = "localhost/pybase:1"
MIB = 1 << 20

# Fills /tmp and /dev/shm past half the job's memory, forks past its process limit, says which
# cgroups it is in, and waits for the test to read their limits (from the host: a job may not).
PROBE = r"""
import errno, json, os, sys, time
mem_mib, forks = int(sys.argv[1]), int(sys.argv[2])
out = {}
for d in ("/tmp", "/var/tmp", "/dev/shm"):
    path = os.path.join(d, "fill")
    try:
        with open(path, "wb") as f:
            for _ in range(mem_mib * 3 // 4):
                f.write(b"x" * (1 << 20))
        out[d] = "wrote"
    except OSError as e:
        out[d] = errno.errorcode.get(e.errno, str(e.errno))
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
kids = []
try:
    for _ in range(forks):
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        kids.append(pid)
    out["fork"] = "all"
except OSError as e:
    out["fork"] = errno.errorcode.get(e.errno, str(e.errno))
out["forked"] = len(kids)
for k in kids:
    os.kill(k, 9)
    os.waitpid(k, 0)
out["cgroup"] = open("/proc/self/cgroup").read()
print(json.dumps(out), flush=True)
go = os.path.join(os.environ["CPOOL_RUN_DIR"], "go")
for _ in range(600):  # held while the test reads the cgroup's limits from the host
    if os.path.exists(go):
        break
    time.sleep(0.2)
"""
HOG = "import sys\nheld = b'x' * (int(sys.argv[1]) << 20)\nprint('held it all', flush=True)\n"


def _remove_cgroup_base(base: str) -> None:
    """The test's cgroup base, wherever it lies (one per controller on v1, one on v2), deepest first."""
    for top in [*Path("/sys/fs/cgroup").glob(f"*/{base}"), Path("/sys/fs/cgroup") / base]:
        if top.is_dir():
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                d.rmdir()
            top.rmdir()


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    """The pool, its agent's job cgroups under a base of this test's own."""
    base = f"cpool-limits-{uuid.uuid4().hex[:8]}"
    try:
        with job_node(env={"CPOOL_CGROUP_BASE": f"/sys/fs/cgroup/{base}"}) as n:
            yield n
    finally:
        _remove_cgroup_base(base)


@pytest.fixture
def tenant(node: Node) -> tuple[str, httpx.Client]:
    return node.member("dl")


def _submit(client: httpx.Client, command: list[str], **kw: Any) -> int:
    """A job that names no CPU or memory."""
    r = client.post("/api/v1/allocations", json={"command": command, **kw})
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def _ended(node: Node, client: httpx.Client, aid: int) -> tuple[dict[str, Any], str]:
    """The allocation once it ended, and its stdout."""

    def ended() -> dict[str, Any] | None:
        a = dict(client.get(f"/api/v1/allocations/{aid}").json())
        return a if a["state"] in ENDED else None

    a = wait_for(f"allocation {aid} to end", ended, 180, node.logs)
    return a, str(client.get(f"/api/v1/allocations/{aid}/logs").json()["stdout"]["data"])


def _limits(cgroup: str) -> dict[str, int]:
    """The tightest memory, CPU quota and process limits over the job's cgroups and their parents
    (a container's memory limit sits on a parent the agent made), read as root on the host."""
    found: dict[str, list[int]] = {"memory": [], "cpu": [], "pids": []}
    files = {"memory.max": "memory", "memory.limit_in_bytes": "memory", "pids.max": "pids"}
    for line in cgroup.splitlines():
        _, ctrls, path = line.split(":", 2)
        for ctrl in ctrls.split(","):
            root = Path("/sys/fs/cgroup") / ctrl if ctrl else Path("/sys/fs/cgroup")
            for d in (root / path.lstrip("/"), *(root / path.lstrip("/")).parents):
                if not d.is_relative_to(root):
                    break
                for name, kind in files.items():
                    if (d / name).is_file() and (d / name).read_text().strip().isdigit():
                        found[kind].append(int((d / name).read_text()))
                for name in ("cpu.max", "cpu.cfs_quota_us"):
                    quota = (d / name).read_text().split()[0] if (d / name).is_file() else ""
                    if quota.isdigit():
                        found["cpu"].append(int(quota))
    return {kind: min(values) for kind, values in found.items() if values}


def _probe(
    node: Node, client: httpx.Client, command: list[str], **kw: Any
) -> tuple[dict[str, Any], dict[str, int]]:
    """Run PROBE: what it saw, and the limits of its cgroups while it ran."""
    aid = _submit(client, [*command, "-c", PROBE, "64", "64"], **kw)

    def said() -> str | None:
        out = str(client.get(f"/api/v1/allocations/{aid}/logs").json()["stdout"]["data"])
        if client.get(f"/api/v1/allocations/{aid}").json()["state"] in ENDED:
            raise AssertionError(f"the probe ended early: {out!r}\n{node.logs()}")
        return out if out.endswith("\n") else None

    seen = json.loads(wait_for("the probe's report", said, 180, node.logs).strip().splitlines()[-1])
    limits = _limits(seen["cgroup"])
    (node.agent_dir / "runs" / str(aid) / "1" / "work" / "go").touch()
    a, out = _ended(node, client, aid)
    assert a["state"] == "released", (a["reason"], out)
    return seen, limits


def _cli(node: Node, *args: str) -> subprocess.CompletedProcess[str]:
    env = node.env | {"CPOOL_SERVER": node.url, "CPOOL_TOKEN": node.token}
    return subprocess.run(cpool(*args), env=env, capture_output=True, text=True, timeout=60)


def _ps(node: Node) -> list[dict[str, Any]]:
    done = _cli(node, "ps", "--all", "--json")
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def test_a_job_that_asks_for_nothing_is_booked_and_held_to_the_pools_default(
    node: Node, tenant: tuple[str, httpx.Client]
) -> None:
    _, client = tenant
    a, out = _ended(node, client, _submit(client, [JOB_PYTHON, "-c", HOG, "1536"]))  # the default: 1 GiB
    assert a["state"] == "failed" and "out of memory" in a["reason"], (a["state"], a["reason"], out)
    assert "held it all" not in out
    [mine] = [x for x in _ps(node) if x["id"] == a["id"]]
    assert (mine["request"]["cpu_milli"], mine["request"]["memory_mib"]) == (1000, 1024)


def test_a_process_job_is_held_to_its_tenants_defaults(node: Node, tenant: tuple[str, httpx.Client]) -> None:
    name, client = tenant
    bad = _cli(node, "tenants", "defaults", name, "--mem", "lots")
    assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0 and "--mem" in bad.stderr, bad.stderr
    done = _cli(node, "tenants", "defaults", name, "--mem", "64MiB", "--pids", "32", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "tenant": name,
        "cpu_milli": 1000,
        "memory_mib": 64,
        "pids_max": 32,
        "time_limit_s": None,
        "max_time_limit_s": None,
        "max_array": None,
        "from_pool": ["cpu_milli"],
    }
    hog, out = _ended(node, client, _submit(client, [JOB_PYTHON, "-c", HOG, "256"]))
    assert hog["state"] == "failed" and "out of memory" in hog["reason"], (hog["reason"], out)
    assert (hog["request"]["cpu_milli"], hog["request"]["memory_mib"]) == (1000, 64)
    seen, limits = _probe(node, client, [JOB_PYTHON])
    # /tmp, /var/tmp and /dev/shm hold 32 MiB each: a 48 MiB write fails before the memory limit is reached
    assert (seen["/tmp"], seen["/var/tmp"], seen["/dev/shm"]) == ("ENOSPC",) * 3, seen
    assert seen["fork"] == "EAGAIN" and 0 < seen["forked"] < 32, seen
    assert limits == {"memory": 64 * MIB, "cpu": 100_000, "pids": 32}, (limits, seen["cgroup"])


def test_a_container_job_is_held_to_its_tenants_defaults(
    node: Node, tenant: tuple[str, httpx.Client], image: str
) -> None:
    name, client = tenant
    publish_image(node.admin, image, [name])
    r = node.admin.patch(f"/api/v1/tenants/{name}/defaults", json={"memory_mib": 64, "pids_max": 32})
    assert r.status_code == 200, r.text
    hog, out = _ended(node, client, _submit(client, ["python3", "-c", HOG, "256"], image=image))
    assert hog["state"] == "failed" and "out of memory" in hog["reason"], (hog["reason"], out)
    seen, limits = _probe(node, client, ["python3"], image=image)
    # /var/tmp too: the image's world-writable dirs were the overlay's, on the node's disk, unbounded
    assert (seen["/tmp"], seen["/var/tmp"], seen["/dev/shm"]) == ("ENOSPC",) * 3, seen
    assert seen["fork"] == "EAGAIN" and 0 < seen["forked"] < 32, seen
    assert limits == {"memory": 64 * MIB, "cpu": 100_000, "pids": 32}, (limits, seen["cgroup"])
