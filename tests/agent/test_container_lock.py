"""Slow podman work never holds the executor's lock: a pull (before the start) and `podman rm` (after
the end) run outside it, so other starts and polls go on meanwhile.

The slowness is real and unbounded: podman is a shell script that, for the slow subcommands, marks
that it began and then waits until the test lets it go, before it execs the real podman. A start or
a poll that returns while that subcommand is still held cannot have waited for it, however slow
the machine; one that waited would never return before the release. Every container here is a
real one, started with the test image (built once by scripts/build-test-image.sh).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.container import Podman
from computepool.agent.executor import Executor, JobSpec, SandboxConfig
from computepool.agent.localstate import JobRecord, JobState
from computepool.agent.tenants import remove_tenant_user

IMAGE = "localhost/pybase:1"
HELD_S = 120.0  # the longest a call may take while podman is held before the test calls it stuck


@pytest.fixture
def data(image: str) -> Iterator[Path]:
    data = Path("/var/tmp") / f"cpool-lock-{uuid.uuid4().hex[:8]}"
    data.mkdir()
    yield data
    engine = Podman(data / "agent")
    for key in engine.all_keys():
        engine.remove(key)
    shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def tenant() -> Iterator[str]:
    name = f"t{uuid.uuid4().hex[:8]}"
    yield name
    remove_tenant_user(name)


def slow_podman(data: Path, slow: tuple[str, ...]) -> tuple[Path, Path, Path]:
    """A podman binary whose `slow` subcommands ("pull", "image inspect", "rm") first mark that they
    began, then wait until the release file exists. Returns the binary, the mark and the release."""
    mark, release = data / "slow-started", data / "slow-release"
    script = data / "slow-podman"
    wait = f"touch {mark}; while [ ! -e {release} ]; do sleep 0.05; done"
    cases = "\n".join(f'  "{sub}"*) {wait} ;;' for sub in slow)
    script.write_text(f'#!/bin/sh\ncase "$*" in\n{cases}\nesac\nexec {shutil.which("podman")} "$@"\n')
    script.chmod(0o700)
    return script, mark, release


def executor_with(data: Path, binary: Path) -> Executor:
    ex = Executor(data / "agent", cgroup_base=None, kill_grace_s=2.0, sandbox=SandboxConfig())
    ex.launcher._podman = Podman(ex.data_dir, binary=str(binary))  # the agent's podman, slowed down
    return ex


def wait_for(what: str, cond: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def while_held(release: Path, what: str, fn: object) -> object:
    """`fn()`'s result, which must come while podman is still held (it could not have waited on it)."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)  # type: ignore[operator]
    t.start()
    t.join(HELD_S)
    assert not t.is_alive(), f"{what} waited for the held podman"
    assert not release.exists()
    return out[0]


def test_a_slow_pull_holds_up_no_other_start_or_poll(data: Path, tenant: str) -> None:
    binary, mark, release = slow_podman(data, ("image inspect", "pull"))
    ex = executor_with(data, binary)
    started: list[JobRecord] = []
    ctr = threading.Thread(
        target=lambda: started.append(
            ex.start(JobSpec("ctr", 1, ["python3", "-c", "print('in')"], tenant=tenant, image=IMAGE))
        ),  # fmt: skip
    )
    try:
        ctr.start()
        wait_for("the image check to begin", mark.exists)
        proc = while_held(
            release, "a process job's start",
            lambda: ex.start(JobSpec("proc", 1, ["python3", "-c", "print('p')"], tenant=tenant)),
        )  # fmt: skip
        assert isinstance(proc, JobRecord) and proc.state is JobState.RUNNING, proc
        while_held(release, "poll()", ex.poll)
        assert ctr.is_alive(), "the container start did not wait for its image: the test proves nothing"
        release.touch()
        ctr.join(60)
        assert started and started[0].state is JobState.RUNNING, started
        assert (ex.wait("proc#1", 60).state, ex.wait("ctr#1", 90).state) == (JobState.SUCCEEDED,) * 2
        assert Podman(ex.data_dir).all_keys() == set()
    finally:
        release.touch()
        ctr.join(60)
        ex.close()
        ex.state.close()


def test_a_missing_image_still_fails_the_job_at_once(data: Path, tenant: str) -> None:
    ex = executor_with(data, Path(shutil.which("podman") or "podman"))
    ex.launcher.container_engine().pull = False
    try:
        rec = ex.start(JobSpec("none", 1, ["true"], tenant=tenant, image="localhost/no-such-image:1"))
        assert rec.state is JobState.FAILED
        assert rec.reason == (
            f"could not start: image localhost/no-such-image:1 not found on node {os.uname().nodename} "
            "(pulling is off)"
        )
        assert [r.key for r in ex.poll()] == [rec.key]
    finally:
        ex.close()
        ex.state.close()


def test_ended_containers_are_removed_off_the_lock(data: Path, tenant: str) -> None:
    binary, mark, release = slow_podman(data, ("rm",))
    ex = executor_with(data, binary)
    try:
        first = ex.start(JobSpec("c1", 1, ["python3", "-c", "print(1)"], tenant=tenant, image=IMAGE))
        second = ex.start(JobSpec("c2", 1, ["python3", "-c", "print(2)"], tenant=tenant, image=IMAGE))
        assert (first.state, second.state) == (JobState.RUNNING,) * 2, (first.reason, second.reason)
        ended: set[str] = set()
        deadline = time.monotonic() + 90
        while not mark.exists() and time.monotonic() < deadline:  # until a removal is held
            ended |= {r.key for r in ex.poll()}
            time.sleep(0.05)
        assert mark.exists(), "podman rm was never asked"
        got = while_held(release, "poll()", ex.poll)
        ended |= {r.key for r in got}  # type: ignore[attr-defined]
        other = while_held(release, "a start", lambda: ex.start(JobSpec("p", 1, ["true"], tenant=tenant)))
        assert isinstance(other, JobRecord) and other.state is JobState.RUNNING, other
        release.touch()
        wait_for(
            "both ends", lambda: ended.update(r.key for r in ex.poll()) or ended >= {first.key, second.key}
        )
        assert ex.wait(first.key, 60).state is JobState.SUCCEEDED  # and its container is gone
        assert first.key not in Podman(ex.data_dir).all_keys()
        ex.close()  # drains the rest
        assert Podman(ex.data_dir).all_keys() == set()
    finally:
        release.touch()
        ex.close()
        ex.state.close()
