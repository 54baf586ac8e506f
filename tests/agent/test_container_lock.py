"""Slow podman work never holds the executor's lock: a pull (before the start) and `podman rm` (after
the end) run outside it, so other starts and polls go on meanwhile.

The slowness is real: podman is a shell script that sleeps before the slow subcommands and then
execs the real podman, so every container here is a real one, started with the test image (built
once by scripts/build-test-image.sh).
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
SLOW_S = 8.0  # how long the slow podman subcommands take
PROMPT_S = 3.0  # "promptly": well under SLOW_S, with room for a loaded machine


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


def slow_podman(data: Path, slow: tuple[str, ...]) -> tuple[Path, Path]:
    """A podman binary whose `slow` subcommands ("pull", "image exists", "rm") first mark and sleep."""
    mark = data / "slow-started"
    script = data / "slow-podman"
    cases = "\n".join(f'  "{sub}"*) touch {mark}; sleep {SLOW_S:g} ;;' for sub in slow)
    script.write_text(f'#!/bin/sh\ncase "$*" in\n{cases}\nesac\nexec {shutil.which("podman")} "$@"\n')
    script.chmod(0o700)
    return script, mark


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


def timed(fn: object) -> tuple[object, float]:
    t0 = time.monotonic()
    out = fn()  # type: ignore[operator]
    return out, time.monotonic() - t0


def test_a_slow_pull_holds_up_no_other_start_or_poll(data: Path, tenant: str) -> None:
    binary, mark = slow_podman(data, ("image exists", "pull"))
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

        proc, took = timed(
            lambda: ex.start(JobSpec("proc", 1, ["python3", "-c", "print('p')"], tenant=tenant))
        )
        assert isinstance(proc, JobRecord) and proc.state is JobState.RUNNING, proc
        assert took < PROMPT_S, f"a process job took {took:.1f} s to start behind a slow pull"
        _, took = timed(ex.poll)
        assert took < PROMPT_S, f"poll() took {took:.1f} s behind a slow pull"
        assert ctr.is_alive(), "the container start did not wait for its image: the test proves nothing"

        ctr.join(60)
        assert started and started[0].state is JobState.RUNNING, started
        assert (ex.wait("proc#1", 60).state, ex.wait("ctr#1", 90).state) == (JobState.SUCCEEDED,) * 2
        assert Podman(ex.data_dir).all_keys() == set()
    finally:
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
    binary, mark = slow_podman(data, ("rm",))
    ex = executor_with(data, binary)
    try:
        first = ex.start(JobSpec("c1", 1, ["python3", "-c", "print(1)"], tenant=tenant, image=IMAGE))
        second = ex.start(JobSpec("c2", 1, ["python3", "-c", "print(2)"], tenant=tenant, image=IMAGE))
        assert (first.state, second.state) == (JobState.RUNNING,) * 2, (first.reason, second.reason)
        ended: set[str] = set()
        slowest = 0.0
        deadline = time.monotonic() + 90
        while ended != {first.key, second.key} and time.monotonic() < deadline:
            got, took = timed(ex.poll)
            ended |= {r.key for r in got}  # type: ignore[attr-defined]
            slowest = max(slowest, took)
            time.sleep(0.05)
        assert ended == {first.key, second.key}
        assert mark.exists(), "podman rm was never asked"
        assert slowest < PROMPT_S, f"poll() took {slowest:.1f} s while containers were removed"

        other, took = timed(lambda: ex.start(JobSpec("p", 1, ["true"], tenant=tenant)))
        assert isinstance(other, JobRecord) and other.state is JobState.RUNNING, other
        assert took < PROMPT_S, f"a start took {took:.1f} s while containers were removed"

        assert ex.wait(first.key, 60).state is JobState.SUCCEEDED  # and its container is gone
        assert first.key not in Podman(ex.data_dir).all_keys()
        ex.close()  # drains the rest
        assert Podman(ex.data_dir).all_keys() == set()
    finally:
        ex.close()
        ex.state.close()
