"""Container jobs through the executor: the same gate, exit file, logs, stop and re-adoption as
process jobs, with real rootful podman and the test image (built once by scripts/build-test-image.sh)."""

from __future__ import annotations

import pwd
import time
from pathlib import Path

from computepool.agent.container import Podman
from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec, SandboxConfig
from computepool.agent.localstate import JobState

IMAGE = "localhost/pybase:1"


def _spec(name: str, tenant: str, code: str, **kw: object) -> JobSpec:
    return JobSpec(name, 1, ["python3", "-c", code], tenant=tenant, image=IMAGE, **kw)  # type: ignore[arg-type]


def _wait_out(rec_run_dir: str, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in (Path(rec_run_dir) / STDOUT_LOG).read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never appeared in the job's output")


def test_a_container_job_runs_as_its_tenant_and_is_removed_at_the_end(
    container_executor: tuple[Executor, str],
) -> None:
    ex, tenant = container_executor
    code = "import os; print(os.getuid(), os.getgid(), os.getcwd(), sorted(os.environ)); raise SystemExit(4)"
    rec = ex.start(_spec("c1", tenant, code, env={"SLICE": "1"}))
    assert rec.state is JobState.RUNNING, rec.reason
    assert rec.limits.startswith(f"container {IMAGE} through podman")
    done = ex.wait(rec.key, 90)
    assert (done.state, done.exit_code, done.reason) == (JobState.FAILED, 4, "exit code 4")
    user = pwd.getpwnam(f"cpool-{tenant}")
    uid, gid, cwd, *_ = (Path(done.run_dir) / STDOUT_LOG).read_text().split(maxsplit=3)
    assert (int(uid), int(gid), cwd) == (user.pw_uid, user.pw_gid, "/work")
    assert Podman(ex.data_dir).all_keys() == set()  # removed once its end was read


def test_stopping_a_container_job_reaches_the_workload(container_executor: tuple[Executor, str]) -> None:
    ex, tenant = container_executor
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (print('saved', flush=True), sys.exit(0)))\n"
        "print('ready', flush=True)\ntime.sleep(120)\n"
    )
    rec = ex.start(_spec("c2", tenant, code))
    _wait_out(rec.run_dir, "ready")
    done = ex.kill(rec.key, "drain", grace_s=20)
    assert (done.state, done.reason) == (JobState.KILLED, "drain")
    assert "saved" in (Path(done.run_dir) / STDOUT_LOG).read_text()
    stubborn = ex.start(
        _spec(
            "c3",
            tenant,
            "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('ready', flush=True)\ntime.sleep(120)\n",
        )  # fmt: skip
    )
    _wait_out(stubborn.run_dir, "ready")
    done = ex.kill(stubborn.key, "stop now", grace_s=0.5)
    assert done.state is JobState.KILLED
    assert Podman(ex.data_dir).all_keys() == set()  # the container went with its killed client


def test_a_killed_container_job_ends_only_once_its_container_is_gone(
    container_executor: tuple[Executor, str],
) -> None:
    """`podman run` dies at once from SIGKILL; its container lives on until it is removed. The job
    leaves `running()` and is reported ended only then: the node starts nothing else on its devices
    while the container's processes may still hold them."""
    ex, tenant = container_executor
    code = (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\ntime.sleep(120)\n"
    )
    rec = ex.start(_spec("c4", tenant, code))
    _wait_out(rec.run_dir, "ready")
    ex.stop(rec.key, "stop now", grace_s=0)
    deadline = time.monotonic() + 90
    ended: list[str] = []
    while not ended and time.monotonic() < deadline:
        ended = [r.key for r in ex.poll()]
        if not ended:
            assert rec.key in {r.key for r in ex.running()}
            time.sleep(0.01)
    assert ended == [rec.key]
    assert rec.key not in Podman(ex.data_dir).all_keys(), "ended while its container still existed"


def test_a_restarted_executor_adopts_a_running_container_job(
    container_executor: tuple[Executor, str],
) -> None:
    ex, tenant = container_executor
    rec = ex.start(_spec("c4", tenant, "import time; print('ready', flush=True); time.sleep(3)"))
    _wait_out(rec.run_dir, "ready")
    again = Executor(ex.data_dir, ex.state, cgroup_base=None, sandbox=SandboxConfig())
    found = again.adopt()
    assert [r.key for r in found.adopted] == [rec.key]
    done = again.wait(rec.key, 60)
    assert (done.state, done.exit_code) == (JobState.SUCCEEDED, 0)
    assert Podman(ex.data_dir).all_keys() == set()
