"""Tenants' process jobs share no /var/tmp and no /run/lock, and leave nothing there.

Both were the host's: every tenant's job saw the names the others made there, and what a job wrote
stayed after it, with no bound. Where fs.protected_regular is 0, tenant B's job pre-created
/var/tmp/report.txt with mode 0666, tenant A's job wrote its report there, and B's next job read it.
Each job now has a private /var/tmp (sized and counted like its /tmp) and /run/lock, gone with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator

import httpx
import pytest
from e2e_helpers import JOB_PYTHON
from job_node import Node, job_node

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent")]

DIRS = ("/var/tmp", "/run/lock")

# argv: mode (plant | use | steal), the file's name
SCRATCH = r"""
import errno, json, os, sys
mode, name = sys.argv[1], sys.argv[2]
out = {}
for d in ("/var/tmp", "/run/lock"):
    path = os.path.join(d, name)
    if not os.path.isdir(d):
        continue
    try:
        if mode == "plant":
            os.umask(0)
            open(path, "w").close()
            os.chmod(path, 0o666)
            out[d] = "planted"
        elif mode == "use":
            with open(path, "w") as f:
                f.write("A-SECRET")
            out[d] = "wrote"
        else:
            out[d] = open(path).read()
    except OSError as e:
        out[d] = errno.errorcode.get(e.errno, str(e.errno))
if mode == "use":  # /var/tmp holds half the job's memory, as /tmp does
    try:
        with open("/var/tmp/fill", "wb") as f:
            for _ in range(96):
                f.write(b"x" * (1 << 20))
        out["fill"] = "wrote"
    except OSError as e:
        out["fill"] = errno.errorcode.get(e.errno, str(e.errno))
    finally:
        os.unlink("/var/tmp/fill")
print(json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with job_node() as n:
        yield n


def _run(node: Node, client: httpx.Client, mode: str, name: str) -> dict[str, str]:
    aid = node.submit(client, [JOB_PYTHON, "-c", SCRATCH, mode, name], memory_mib=128)
    job = node.ended(client, aid)
    out = client.get(f"/api/v1/allocations/{aid}/logs").json()["stdout"]["data"]
    assert job["state"] == "released", f"{job}\n{out}\n{node.logs()}"
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_a_tenant_reads_nothing_through_a_file_it_planted_in_var_tmp_and_nothing_stays(node: Node) -> None:
    _, a = node.member("va")
    _, b = node.member("vb")
    name = f"report-{uuid.uuid4().hex[:8]}.txt"
    here = [d for d in DIRS if os.path.isdir(d)]
    try:
        assert _run(node, b, "plant", name) == dict.fromkeys(here, "planted")
        assert _run(node, a, "use", name) == {**dict.fromkeys(here, "wrote"), "fill": "ENOSPC"}
        assert _run(node, b, "steal", name) == dict.fromkeys(here, "ENOENT")  # B's own, empty
        assert [d for d in here if os.path.exists(os.path.join(d, name))] == []  # none on the host
    finally:  # what the jobs left on the host before the fix
        for d in here:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d, name))
