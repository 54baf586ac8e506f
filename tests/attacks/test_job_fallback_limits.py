"""A root agent whose jobs no cgroup can hold still caps each tenant's processes, and says so.

With no writable cgroup (`--cgroup-base none`, a container without delegation) a job was held by
RLIMIT_AS, per process, and CPU affinity alone: a 64 MiB job held 222 MiB through four children, and
it could fork without bound (its RLIMIT_NPROC was the host's default, above pid_max). The agent now
sets RLIMIT_NPROC to the tenant's process limit there (counted per user: all the tenant's jobs on
the node together) and a root agent says at its start, as a WARNING, that memory is held per
process only and one tenant's job can starve another's.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from e2e_helpers import JOB_PYTHON, cpool
from job_node import job_node

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent")]

FORK = r"""
import errno, json, os, time
kids, why = [], "all"
try:
    for _ in range(200):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        kids.append(pid)
except OSError as e:
    why = errno.errorcode.get(e.errno, str(e.errno))
for k in kids:
    os.kill(k, 9)
    os.waitpid(k, 0)
print(json.dumps({"forked": len(kids), "stopped": why}), flush=True)
"""


def test_without_cgroups_a_job_cannot_fork_past_its_tenants_process_limit() -> None:
    with job_node(env={"CPOOL_CGROUP_BASE": "none"}) as node:
        warnings = [ln for ln in node.logs().splitlines() if " WARNING " in ln and "no usable cgroups" in ln]
        assert len(warnings) == 1 and "per process" in warnings[0], node.logs()
        name, client = node.member("fl")
        env = node.env | {"CPOOL_SERVER": node.url, "CPOOL_TOKEN": node.token}
        done = subprocess.run(cpool("tenants", "defaults", name, "--pids", "48"), env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        aid = node.submit(client, [JOB_PYTHON, "-c", FORK])
        job = node.ended(client, aid)
        out = client.get(f"/api/v1/allocations/{aid}/logs").json()["stdout"]["data"]
        assert job["state"] == "released", f"{job}\n{out}\n{node.logs()}"
        seen = json.loads(out.strip().splitlines()[-1])
        assert seen["stopped"] == "EAGAIN" and 0 < seen["forked"] < 48, seen
