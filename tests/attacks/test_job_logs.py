"""A job cannot fill the pool's database with its output.

A tenant's job printed 200 MiB to stdout and every byte went into the control plane's database
(pool.db grew to 202 MB): enough such jobs and the pool's disk is full for everyone. Each attempt's
stream now keeps its last `--log-max-mib` (the oldest chunks dropped as new ones come, one line in
the log saying how much went), each tenant its newest `--tenant-log-max-mib` in all, and logs of
allocations ended long ago are deleted (tests/server/test_log_limits.py).
"""

from __future__ import annotations

import os
import sqlite3
import subprocess

import pytest
from e2e_helpers import JOB_PYTHON, cpool
from job_node import job_node

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent")]

MIB = 1 << 20
FLOOD = """
import sys
line = "x" * 1023 + "\\n"
for i in range(12 * 1024):  # 12 MiB
    sys.stdout.write(line)
print("the last line", flush=True)
"""


def test_a_job_printing_far_past_the_cap_keeps_only_the_cap_and_says_so() -> None:
    with job_node("--log-max-mib", "4") as node:
        tenant, client = node.member("flood")
        aid = node.submit(client, [JOB_PYTHON, "-c", FLOOD])
        job = node.ended(client, aid, timeout=300)
        assert job["state"] == "released", f"{job}\n{node.logs()}"
        with sqlite3.connect(node.srv_dir / "pool.db") as db:
            sql = "SELECT SUM(LENGTH(CAST(data AS BLOB))) FROM allocation_logs WHERE allocation_id = ?"
            (held,) = db.execute(sql, (aid,)).fetchone()
        assert held <= 4 * MIB + 200, held  # the cap, and the line saying what went
        shown = subprocess.run(
            cpool("logs", str(aid)), env=node.cli_env(tenant), capture_output=True, text=True, timeout=120
        )
        assert shown.returncode == 0, shown.stderr
        first = shown.stdout.splitlines()[0]
        assert first.startswith("[cpool: ") and "bytes of this attempt's stdout dropped" in first, first
        dropped = int(first.split()[1])
        assert dropped >= 12 * MIB + len("the last line\n") - 4 * MIB, first
        assert shown.stdout.endswith("the last line\n")
        assert len(shown.stdout.encode()) - len(first) - 1 <= 4 * MIB
