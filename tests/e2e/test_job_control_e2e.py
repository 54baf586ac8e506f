"""`cpool run --array`, `--after` and `--retries` on a real pool (`cpool up`): every member's output
prefixed with its index, dependencies met and never met, every attempt's output."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from collections.abc import Iterator

import pytest
from e2e_helpers import JOB_PYTHON, Pool, child_env, cpool, free_port, stop, wait_for


@pytest.fixture(scope="module")
def pool_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("jobctl")
    data, port, log = tmp / "pool", free_port(), tmp / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cpool("up", "--simulate", "1xA100-80GB", "--data-dir", str(data), "--port", str(port)),
            stdout=out, stderr=subprocess.STDOUT, env=child_env(),
        )  # fmt: skip
    try:
        wait_for("cpool up", lambda: "ComputePool is up" in log.read_text(), 60, log.read_text)
        pool = Pool(f"https://127.0.0.1:{port}", data)
        wait_for("the local node", lambda: [n["state"] for n in pool.nodes()] == ["ready"], 30)
        pool.close()
        env = child_env()
        env["CPOOL_SERVER"] = f"https://127.0.0.1:{port}"
        env["CPOOL_CA"] = str(data / "tls" / "cert.pem")
        env["CPOOL_TOKEN"] = (data / "admin-token").read_text().strip()
        yield env
    finally:
        stop(proc, signal.SIGINT, timeout=40)


def run(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cpool(*args), env=env, capture_output=True, text=True, timeout=timeout)


def test_array_runs_every_index_and_fails_when_one_fails(pool_env: dict[str, str]) -> None:
    code = (
        "import os; i = os.environ['CPOOL_ARRAY_INDEX']; "
        "print('idx', i, 'of', os.environ['CPOOL_ARRAY_COUNT']); raise SystemExit(5 if i == '3' else 0)"
    )
    r = run(pool_env, "run", "--cpus", "0.1", "--array", "0-3%2", "--", JOB_PYTHON, "-c", code)
    assert r.returncode == 5, r.stdout + r.stderr
    for i in range(4):
        assert f"[{i}] idx {i} of 4" in r.stdout.splitlines(), r.stdout
    assert "Traceback" not in r.stderr
    first = int(re.findall(r"array (\d+): 4 jobs", r.stderr)[0])
    ps = json.loads(run(pool_env, "ps", "--all", "--json").stdout)
    mine = sorted((a for a in ps if a.get("array_id") == first), key=lambda a: a["array_index"])
    assert [a["array_index"] for a in mine] == [0, 1, 2, 3]
    assert [a["state"] for a in mine] == ["released", "released", "released", "failed"]
    logs = run(pool_env, "logs", str(first))
    assert "[2] idx 2 of 4" in logs.stdout and logs.returncode == 0, logs.stdout + logs.stderr
    one = run(pool_env, "logs", f"{first}_3")
    assert one.stdout == "idx 3 of 4\n", one.stdout + one.stderr
    bad = run(pool_env, "run", "--array", "5-1", "--", "true")
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert bad.returncode != 0 and len(lines) == 1 and "--array" in lines[0], bad.stderr


def test_after_met_and_never_met(pool_env: dict[str, str]) -> None:
    failed = run(pool_env, "run", "--cpus", "0.1", "--", JOB_PYTHON, "-c", "raise SystemExit(4)")
    assert failed.returncode == 4
    fid = re.findall(r"job (\d+) failed", failed.stderr)[0]
    never = run(pool_env, "run", "--cpus", "0.1", "--after", fid, "--", JOB_PYTHON, "-c", "print('x')")
    assert never.returncode != 0 and "x" not in never.stdout, never.stdout + never.stderr
    assert f"dependency never met: {fid} ended failed" in never.stderr
    went = run(
        pool_env, "run", "--cpus", "0.1", "--after", f"{fid}:failed", "--", JOB_PYTHON, "-c", "print('on')"
    )
    assert went.returncode == 0 and went.stdout == "on\n", went.stdout + went.stderr


def test_retries_follow_every_attempt(pool_env: dict[str, str]) -> None:
    code = "print('try'); raise SystemExit(3)"
    again = run(pool_env, "run", "--cpus", "0.1", "--retries", "1", "--", JOB_PYTHON, "-c", code)
    assert again.returncode == 3 and again.stdout == "try\ntry\n", again.stdout + again.stderr
    rid = re.findall(r"job (\d+) failed", again.stderr)[0]
    [item] = [a for a in json.loads(run(pool_env, "ps", "--all", "--json").stdout) if str(a["id"]) == rid]
    assert item["attempt"] == 2 and item["retries"] == 1
    only = run(
        pool_env,
        "run",
        "--cpus",
        "0.1",
        "--retries",
        "2",
        "--retry-on-exit",
        "7",
        "--",
        JOB_PYTHON,
        "-c",
        code,
    )
    assert only.returncode == 3 and only.stdout == "try\n", only.stdout + only.stderr
