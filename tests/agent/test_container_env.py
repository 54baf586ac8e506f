"""A container job's variables reach it through a root-only env file, never podman's command line
(which every user of the node reads with `ps`): with real rootful podman and the test image."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import psutil
import pytest

from computepool.agent.container_env import ENV_FILE, EnvFileError, env_file_text
from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec
from computepool.agent.localstate import JobState

IMAGE = "localhost/pybase:1"
SECRET = "s3cr=t#not-a-comment value "  # `=`, `#`, spaces: carried verbatim, the trailing one too


def test_what_the_env_file_cannot_carry_is_refused_by_name() -> None:
    assert env_file_text({"A": "x=y#z ", "B": " lead", "C": ""}) == "A=x=y#z \nB= lead\nC=\n"
    for env, words in (
        (
            {"PEM": "line1\nline2"},
            "environment variable PEM: a container job's variable cannot hold a line break",
        ),
        ({"CR": "end\r"}, "environment variable CR: a container job's variable cannot hold a line break"),
        ({"#X": "1"}, "environment variable '#X': not a name"),
        ({"A B": "1"}, "environment variable 'A B': not a name"),
        ({"BIG": "x" * 70_000}, "environment variable BIG: longer than"),
    ):
        with pytest.raises(EnvFileError) as e:
            env_file_text(env)
        assert str(e.value).startswith(words), e.value


def _podman_cmdlines(root_pid: int) -> list[str]:
    procs = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    return [" ".join(p.cmdline()) for p in procs if p.is_running()]


def test_the_secret_is_not_on_podmans_command_line(container_executor: tuple[Executor, str]) -> None:
    ex, tenant = container_executor
    code = (
        "import json, os, sys, time\n"
        "print(json.dumps({k: os.environ.get(k) for k in ('CPOOL_SERVICE_KEY', 'OTHER')}), flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {"CPOOL_SERVICE_KEY": SECRET, "OTHER": "plain"}
    rec = ex.start(JobSpec("e1", 1, ["python3", "-c", code], env=env, tenant=tenant, image=IMAGE))
    assert rec.state is JobState.RUNNING, rec.reason
    out = Path(rec.run_dir) / STDOUT_LOG
    deadline = time.monotonic() + 90
    while not out.read_text().strip():
        assert time.monotonic() < deadline, "the container job printed nothing"
        time.sleep(0.1)
    # the job got it, verbatim …
    assert json.loads(out.read_text().splitlines()[0]) == {"CPOOL_SERVICE_KEY": SECRET, "OTHER": "plain"}
    # … while podman, running, shows none of it to `ps` (the whole tree under the job's wrapper)
    lines = _podman_cmdlines(rec.pid)
    assert any("podman" in line and " run " in f" {line} " for line in lines), lines
    assert any("--env-file=" in line for line in lines), lines
    assert not any(SECRET.strip() in line for line in lines), lines
    everyone = []
    for p in psutil.process_iter(["cmdline"]):
        everyone.append(" ".join(p.info["cmdline"] or []))
    assert not any(SECRET.strip() in line for line in everyone)
    # the file podman read: root's alone, in the root-owned run dir, not in the job's work dir
    path = Path(rec.run_dir) / ENV_FILE
    st = path.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 0o600)
    assert f"CPOOL_SERVICE_KEY={SECRET}\n" in path.read_text()
    assert not (Path(rec.run_dir) / "work" / ENV_FILE).exists()
    done = ex.kill(rec.key, "test over", grace_s=0)
    assert done.state is JobState.KILLED


def test_a_variable_podman_cannot_carry_fails_the_job_with_a_reason(
    container_executor: tuple[Executor, str],
) -> None:
    ex, tenant = container_executor
    spec = JobSpec("e2", 1, ["true"], env={"CERT": "-----BEGIN\nx"}, tenant=tenant, image=IMAGE)
    rec = ex.start(spec)
    assert rec.state is not JobState.RUNNING
    assert "environment variable CERT: a container job's variable cannot hold a line break" in rec.reason
