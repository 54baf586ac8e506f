"""`cpool bench failover`: a bad option ends in one line; a short real run (its own PostgreSQL, two
replicas, a simulated node, the leader killed twice) prints the figures the checks read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from poolkit import SRC


def _cpool(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPOOL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "computepool.cli.main", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)


def test_kills_below_one_end_in_one_line() -> None:
    r = _cpool("bench", "failover", "--kills", "0", timeout=60)
    assert r.returncode != 0 and "--kills" in r.stderr and "Traceback" not in r.stderr


def test_two_kills_are_timed_from_kill_to_bind() -> None:
    r = _cpool("bench", "failover", "--kills", "2", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["kills"] == 2 and len(out["samples"]) == 2
    assert set(out["failover_s"]) == {"p50", "max"}
    assert 0 < out["failover_s"]["p50"] <= out["failover_s"]["max"] == max(out["samples"])
