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
        # what went: past the cap on the control plane ("dropped here") and, where the job wrote
        # faster than the node sent, before it on the node ("dropped on the node")
        said = [ln for ln in shown.stdout.splitlines() if ln.startswith("[cpool: ")]
        first = shown.stdout.splitlines()[0]
        assert first.startswith("[cpool: ") and "bytes of this attempt's stdout dropped" in first, first
        dropped = sum(int(ln.split()[1]) for ln in said)
        assert dropped >= 12 * MIB + len("the last line\n") - 4 * MIB, said
        assert shown.stdout.endswith("the last line\n")
        assert len(shown.stdout.encode()) - len(first) - 1 <= 4 * MIB


SPARSE = """
import os
for fd in (1, 2):
    os.ftruncate(fd, 1 << 40)  # 1 TiB of output that was never written (a hole: no disk, no CPU)
print("the last line", flush=True)
"""


def test_a_job_that_grows_its_output_file_to_a_tib_ends_and_leaves_the_node_free() -> None:
    """A job's stdout and stderr are files it holds descriptors to: `ftruncate` made each a 1 TiB
    sparse file in no time, and the node shipped all of it, 256 KiB at a time on its control loop
    (a database write on the control plane each): the job was never reported ended, and 8 such
    jobs of 0.1 CPU slowed another tenant's job on the node from 0.2 s to 3-5 s, for days."""
    with job_node("--log-max-mib", "4") as node:
        tenant, client = node.member("sparse")
        aid = node.submit(client, [JOB_PYTHON, "-c", SPARSE])
        job = node.ended(client, aid, timeout=90)
        assert job["state"] == "released", f"{job}\n{node.logs()}"
        shown = subprocess.run(
            cpool("logs", str(aid)), env=node.cli_env(tenant), capture_output=True, text=True, timeout=120
        )
        assert shown.returncode == 0, shown.stderr
        head = shown.stdout[:200]
        assert head.startswith("[cpool: ") and "stdout dropped" in head, head
        assert shown.stdout.endswith("the last line\n")
        with sqlite3.connect(node.srv_dir / "pool.db") as db:
            sql = (
                "SELECT stream, MAX(stream_offset + size) FROM allocation_logs"
                " WHERE allocation_id = ? AND stream_offset >= 0 GROUP BY stream"
            )
            sent = dict(db.execute(sql, (aid,)).fetchall())
        # what the node sent of each stream: its last 4 MiB (a NUL goes out as 3 bytes) and a line
        assert set(sent) == {"stdout", "stderr"} and max(sent.values()) <= 3 * 4 * MIB + 200, sent
