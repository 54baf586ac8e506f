"""Secrets end to end: set from stdin with `cpool secrets set`, given to a job by `cpool run --secret`
(a real server and agent), and found nowhere else: not in `cpool ps`, the pool's log, its database."""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import JOB_PYTHON, Pool, cpool, local_pool

VALUE = "hf_e2eSECRETvalue_9f3a1c"


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], Pool, Path]]:
    tmp = tmp_path_factory.mktemp("secrets")
    with local_pool(tmp) as (env, pool):
        yield env, pool, tmp


def run(env: dict[str, str], *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cpool(*args), env=env, input=stdin, capture_output=True, text=True, timeout=90)


def test_a_job_gets_the_value_and_nothing_shows_it(up: tuple[dict[str, str], Pool, Path]) -> None:
    env, pool, tmp = up
    r = run(env, "secrets", "set", "HF_TOKEN", stdin=VALUE + "\n")  # `echo`'s newline is dropped
    assert r.returncode == 0 and "HF_TOKEN set" in r.stdout, r.stdout + r.stderr
    listed = run(env, "secrets", "list", "--json")
    assert '"HF_TOKEN"' in listed.stdout and VALUE not in listed.stdout
    code = (
        "import hashlib, os; v = os.environ['HF_TOKEN']; "
        "print('sha', hashlib.sha256(v.encode()).hexdigest(), os.environ['OTHER_VAR'] == v)"
    )
    job = run(env, "run", "-n", "--no-code", "--secret", "HF_TOKEN", "--secret", "HF_TOKEN=OTHER_VAR", "--",
              JOB_PYTHON, "-c", code)  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    assert f"sha {hashlib.sha256(VALUE.encode()).hexdigest()} True" in job.stdout
    ps = run(env, "ps", "--all", "--json")
    assert ps.returncode == 0 and '"HF_TOKEN"' in ps.stdout and VALUE not in ps.stdout
    said = [ps.stdout, pool.http.get("/api/v1/audit", params={"limit": 1000}).text]
    said.append(pool.http.get("/api/v1/allocations", params={"events": "true"}).text)
    assert all(VALUE not in text for text in said)
    on_disk = [p for p in (tmp / "pool").glob("pool.db*")] + [tmp / "up.log"]  # database and log
    assert on_disk and all(VALUE.encode() not in p.read_bytes() for p in on_disk)
    key = tmp / "pool" / "secrets-key"
    assert key.stat().st_mode & 0o777 == 0o600


def test_unknown_names_and_values_on_the_command_line_are_refused(
    up: tuple[dict[str, str], Pool, Path],
) -> None:
    env, _, _ = up
    r = run(env, "run", "-n", "--no-code", "--secret", "NOPE", "--", "true")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and "unknown secret 'NOPE'" in r.stderr and len(lines) == 1, r.stderr
    r = run(env, "secrets", "set", "ARGV_TOKEN", "on-the-command-line")
    assert r.returncode != 0 and "read from stdin" in r.stderr, r.stderr
    assert "ARGV_TOKEN" not in run(env, "secrets", "list").stdout
