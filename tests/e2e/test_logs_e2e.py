"""`cpool run`, `cpool logs` and friends as a new user meets them, on a real local pool.

A job's stdout and stderr stay apart end to end; a long log is printed whole; `logs -f` says how the
job ended; errors print the server's words as is; explain speaks in GPUs and GiB; a run that can't
start says why in one line and leaves nothing behind.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_helpers import JOB_PYTHON, Pool, cpool, local_pool, wait_for

# Lines long enough that a chunk boundary falls inside them, alternating between the two streams.
INTERLEAVED = (
    "import sys\n"
    "for i in range(3000):\n"
    "    (sys.stdout if i % 2 == 0 else sys.stderr).write(f'{i:05d} ' + 'x' * 200 + '\\n')\n"
)
BIG = "import sys\nfor i in range(12000):\n    sys.stdout.write(f'{i:06d} ' + 'y' * 193 + '\\n')\n"


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], Pool]]:
    tmp = tmp_path_factory.mktemp("logs")
    with local_pool(tmp) as (env, p):
        (tmp / "cwd").mkdir()  # `cpool run` ships its working directory: an empty one here
        yield {**env, "PWD": str(tmp / "cwd")}, p


def run(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cpool(*args), env=env, cwd=env["PWD"], capture_output=True, text=True, timeout=timeout
    )


def error_lines(r: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if ln.startswith("error:") or "Traceback" in ln]


def allocations(p: Pool) -> list[dict[str, Any]]:
    return list(p.http.get("/api/v1/allocations").json()["items"])


def test_run_writes_the_jobs_stdout_and_stderr_to_its_own(pool: tuple[dict[str, str], Pool]) -> None:
    env, _ = pool
    r = run(env, "run", "--", "sh", "-c", 'echo OUT; echo ERR >&2; echo "id=$CPOOL_ALLOCATION_ID"')
    assert r.returncode == 0, r.stderr
    job_id = re.search(r"job (\d+)", r.stderr)
    assert job_id, r.stderr
    assert r.stdout == f"OUT\nid={job_id.group(1)}\n"  # nothing of stderr, nothing of ours
    assert "ERR" in r.stderr and "OUT" not in r.stderr


def test_streams_stay_whole_and_in_order(pool: tuple[dict[str, str], Pool]) -> None:
    env, _ = pool
    r = run(env, "run", "--", JOB_PYTHON, "-c", INTERLEAVED)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [f"{i:05d} " + "x" * 200 for i in range(3000)]
    assert r.stdout.splitlines() == lines[0::2]
    job_err = [ln for ln in r.stderr.splitlines() if re.fullmatch(r"\d{5} x+", ln)]
    assert job_err == lines[1::2]  # every stderr line whole, in order; none spliced into another


def test_logs_prints_a_long_log_whole_and_follow_says_how_it_ended(
    pool: tuple[dict[str, str], Pool],
) -> None:
    env, _ = pool
    code = BIG + "sys.stderr.write('giving up\\n'); raise SystemExit(3)\n"
    r = run(env, "run", "--detach", "--", JOB_PYTHON, "-c", code)
    assert r.returncode == 0, r.stderr
    m = re.search(r"job (\d+) submitted", r.stderr)
    assert m, r.stderr
    job_id = m.group(1)
    followed = run(env, "logs", "-f", job_id)
    assert followed.returncode == 3, followed.stderr[-2000:]  # the job's exit code, as `cpool run`
    last = followed.stderr.splitlines()[-1]
    assert last.startswith(f"job {job_id} failed (exit code 3)"), last
    assert "giving up" in followed.stderr
    whole = run(env, "logs", job_id)
    expected = "".join(f"{i:06d} " + "y" * 193 + "\n" for i in range(12000))
    assert len(expected) > 2 * (1 << 20)  # more than a page of the API
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout == expected
    assert whole.stderr == "giving up\n"
    bad = run(env, "logs", "--rank", "1", job_id)
    assert bad.returncode == 1 and len(error_lines(bad)) == 1 and "rank" in bad.stderr, bad.stderr


def test_errors_print_the_servers_text_as_is(pool: tuple[dict[str, str], Pool]) -> None:
    env, p = pool
    before = len(allocations(p))
    r = run(env, "run", "--name", "holdT4", "--", "true")
    assert r.returncode != 0
    assert len(error_lines(r)) == 1, r.stderr
    assert "name" in r.stderr and "^[a-z0-9][a-z0-9_.-]{0,62}$" in r.stderr, r.stderr
    assert len(allocations(p)) == before
    helped = run(env, "run", "--help")
    assert "lowercase letters, digits" in " ".join(helped.stdout.replace("│", " ").split())


def test_a_run_that_can_never_start_says_why_in_one_line(pool: tuple[dict[str, str], Pool]) -> None:
    env, p = pool
    before = len(allocations(p))
    r = run(env, "run", "--gpus", "2", "--", "true")  # the pool has one GPU
    assert r.returncode == 1, r.stdout + r.stderr
    assert len(error_lines(r)) == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(allocations(p)) == before  # nothing half-created


def table_rows(text: str) -> dict[str, list[str]]:
    """The rows of a table `cpool` printed into a pipe, by their first cell."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 2:
            rows[cells[0]] = cells[1:]
    return rows


def test_explain_speaks_in_the_units_users_type(pool: tuple[dict[str, str], Pool]) -> None:
    env, p = pool
    held = run(env, "alloc", "--gpus", "1", "--mem", "1GiB", "--json")
    assert held.returncode == 0, held.stderr
    first = json.loads(held.stdout)
    quota_url = f"/api/v1/tenants/{first['tenant']}/quota"
    quota = {"gpu_milli": {"guaranteed": 0, "limit": 1000}, "memory_mib": {"guaranteed": 0, "limit": 8192}}
    assert p.http.put(quota_url, json=quota).status_code == 200
    try:
        shown = run(env, "alloc", "--gpus", "0.5", "--no-wait")
        assert shown.returncode == 0, shown.stderr
        wait_id = shown.stdout.split()[1]

        def explained() -> str | None:
            out = run(env, "explain", wait_id).stdout
            return out if "quota:" in out else None

        out = wait_for("the quota reason", explained, 30)
        assert "quota: GPU limit 1 (using 1, asks 0.5)" in out, out
        assert "{" not in out and "gpu_milli" not in out and "memory_mib" not in out, out
        rows = table_rows(out)
        assert rows["GPU"] == ["1", "0.5", "0", "1"], out  # in use, this request, guaranteed, limit
        assert rows["memory"][0] == "1GiB" and rows["memory"][-1] == "8GiB", out
        assert run(env, "cancel", wait_id).returncode == 0
        bound = run(env, "explain", str(first["id"])).stdout
        assert "bound on" in bound and "pending" not in bound, bound
    finally:
        run(env, "release", str(first["id"]))
        p.http.put(quota_url, json={})


def test_alloc_names_the_variable_jobs_see(pool: tuple[dict[str, str], Pool]) -> None:
    env, _ = pool
    r = run(env, "alloc", "--cpus", "0.1")
    assert r.returncode == 0, r.stderr
    m = re.search(r"export CPOOL_ALLOCATION_ID=(\d+)", r.stdout)
    assert m, r.stdout
    assert run(env, "release", m.group(1)).returncode == 0


def test_top_prints_a_plain_snapshot_into_a_pipe(pool: tuple[dict[str, str], Pool]) -> None:
    env, _ = pool
    r = run(env, "top", "--iterations", "1")
    assert r.returncode == 0, r.stderr
    assert "A100" in r.stdout and "devices" in r.stdout and "\x1b[" not in r.stdout, r.stdout
