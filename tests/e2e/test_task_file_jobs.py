"""A job from a task file (`cpool run -f task.yaml`) and from Python (`pool.run(...) -> Job`), on a
real local pool: the file's values reach the job, flags override them, a bad file is one line naming
its line and field; a Job waits, reads its logs, answers its exit code and cancels."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import JOB_PYTHON, cpool, local_pool, wait_for

from computepool.sdk import Pool


@pytest.fixture(scope="module")
def pool_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with local_pool(tmp_path_factory.mktemp("taskfile")) as (env, _api):
        yield env


@pytest.fixture(scope="module")
def sdk(pool_env: dict[str, str]) -> Iterator[Pool]:
    with Pool(pool_env["CPOOL_SERVER"], pool_env["CPOOL_TOKEN"], ca=pool_env["CPOOL_CA"]) as pool:
        yield pool


def run(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cpool(*args), env=env, cwd=cwd, capture_output=True, text=True, timeout=60)


SHOW = "import os; print(os.environ.get('GREETING'), bool(os.environ.get('CUDA_VISIBLE_DEVICES')))"


def _task(tmp: Path, body: str) -> Path:
    (tmp / "code").mkdir(exist_ok=True)
    (tmp / "code" / "marker.txt").write_text("shipped\n")
    path = tmp / "task.yaml"
    path.write_text(body)
    return path


def test_task_file_runs_the_job_it_describes(pool_env: dict[str, str], tmp_path: Path) -> None:
    task = _task(
        tmp_path,
        f"""name: from-file
command: "{JOB_PYTHON} -c \\"{SHOW}\\" && cat marker.txt && exit 4"
resources:
  gpus: 0.5
  cpus: 0.5
  mem: 256MiB
env:
  GREETING: hello-from-file
code: code
retries: 0
time_limit: 5m
""",
    )
    r = run(pool_env, tmp_path, "run", "-f", str(task))
    assert r.returncode == 4, r.stdout + r.stderr
    assert r.stdout.splitlines() == ["hello-from-file True", "shipped"], r.stderr
    assert "0.5 CPU" in r.stderr and "256MiB" in r.stderr, r.stderr  # the file's resources, as bound


def test_flags_and_words_after_dashes_override_the_file(pool_env: dict[str, str], tmp_path: Path) -> None:
    task = _task(
        tmp_path,
        "command: [false]\nresources: {gpus: 1}\nenv: {GREETING: from-file}\ncode: code\n",
    )
    r = run(
        pool_env, tmp_path, "run", "-f", str(task), "--gpus", "0", "--env", "GREETING=from-flag",
        "--", JOB_PYTHON, "-c", SHOW,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "from-flag False"


@pytest.mark.parametrize(
    ("body", "where", "says"),
    [
        ("command: [true]\nresources:\n  cpus: 1\n  gpus: -1\n", ":4: resources.gpus", "must be ≥ 0"),
        ("command: [true]\nresources:\n  gpuz: 1\n", ":3: resources.gpuz", "unknown key"),
        ("command: [true]\nretries: 99\n", ":2: retries", "20"),
        ("command: [true]\nresources:\n  mem: 10XB\n", ":3: resources.mem", "10XB"),
        ("command: [true\n", ":2", "not valid YAML"),
        ("command: [true]\nenv:\n  1BAD: x\n", ":2: env", "'1BAD'"),
        ("command: [true]\nafter: [12, soon]\n", ":2: after", "'soon'"),
        ("command: [true]\narray: 5-1\n", ":2: array", "5-1"),
    ],
)
def test_a_bad_task_file_is_one_line_naming_line_and_field(
    pool_env: dict[str, str], tmp_path: Path, body: str, where: str, says: str
) -> None:
    task = tmp_path / "task.yaml"
    task.write_text(body)
    r = run(pool_env, tmp_path, "run", "-f", str(task))
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"{task}{where}" in lines[0] and says in lines[0], lines[0]


def test_pool_run_waits_and_reads_logs(sdk: Pool) -> None:
    job = sdk.run("echo hi; echo oops >&2", cpus=0.5)
    assert job.wait(timeout=60) == 0
    assert job.state == "released" and job.exit_code == 0
    assert job.logs() == "hi\n"
    assert job.logs(stream="stderr") == "oops\n"
    assert list(job.logs(follow=True)) == ["hi"]


def test_pool_run_a_failing_job_with_env_and_code(sdk: Pool, tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("from-code\n")
    job = sdk.run(
        [
            JOB_PYTHON,
            "-c",
            "import os; print(open('data.txt').read().strip(), os.environ['X']); raise SystemExit(7)",
        ],
        env={"X": "y"},
        code=tmp_path,
    )
    assert job.wait(timeout=60) == 7
    assert job.exit_code == 7
    assert job.logs() == "from-code y\n"


def test_pool_run_cancel_and_bad_options(sdk: Pool) -> None:
    job = sdk.run("sleep 600", cpus=0.5)
    wait_for("the job to start", lambda: job.state == "active", 60)
    job.cancel()
    job.wait(timeout=60)
    assert job.state == "cancelled"
    with pytest.raises(ValueError, match="gpus"):
        sdk.run("true", gpus="lots")
    with pytest.raises(ValueError, match="after"):
        sdk.run("true", after=["nope"])
    slow = sdk.run("sleep 600", cpus=0.5)
    with pytest.raises(TimeoutError):
        slow.wait(timeout=0.5)
    slow.cancel()
    assert slow.wait(timeout=60) != 0


def test_pool_run_an_array_and_a_dependency(sdk: Pool) -> None:
    arr = sdk.run("exit $CPOOL_ARRAY_INDEX", cpus=0.5, array="0-2")
    assert arr.wait(timeout=60) == 1  # the first non-zero exit code, in index order
    bad = sdk.run("exit 3", cpus=0.5)
    never = sdk.run("echo never", cpus=0.5, after=[bad])  # bad does not exit 0: never met
    assert never.wait(timeout=60) != 0
    assert never.state == "failed" and never.logs() == ""
