"""A bounded, seeded chaos run, as CI can afford it: two replicas on a PostgreSQL of the run's own,
three root agents with simulated GPUs, a random workload for a minute while the leader is killed, a
whole node is frozen past the lost time and PostgreSQL is stopped; then the oracle
(computepool/chaos/oracle.py). Any violation fails the test with the oracle's words."""

from __future__ import annotations

import glob
import os
import shutil
import uuid
from pathlib import Path

import pytest

from computepool.chaos.run import run_chaos

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="the pool's nodes are root agents")]

KINDS = ("leader_kill", "freeze_node", "database_stop")


def test_a_short_seeded_run_under_faults_loses_nothing_and_runs_nothing_twice() -> None:
    if not glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        pytest.skip("PostgreSQL binaries not found under /usr/lib/postgresql/*/bin")
    root = Path("/var/tmp") / f"cpool-chaos-test-{uuid.uuid4().hex[:8]}"
    lines: list[str] = []
    try:
        out = run_chaos(1.0, seed=11, kinds=KINDS, root=root, say=lines.append)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    detail = "\n".join(lines + out["fault_log"])
    assert out["violations"] == [], detail
    assert out["lost"] == 0 and out["duplicates"] == 0, out
    assert {k: out["faults"].get(k, 0) >= 1 for k in KINDS} == dict.fromkeys(KINDS, True), out
    assert out["acknowledged"] > 20 and out["capacity_samples"] > 20, out  # it did run and look
    assert out["ledger_checked"] > 0, out  # and compared the ledger with what was held
    assert out["failover_s"]["max"] is not None, out  # a bind after the leader's kill was seen
