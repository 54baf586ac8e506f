"""Jobs' progress: a real job writes its step count through the SDK, the agent's reader turns it
into steps/s once it advances and says nothing while it does not; links and FIFOs are not read."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from computepool.agent.executor import Executor, JobSpec
from computepool.agent.progress import ProgressReader, RunningJob, read_progress
from computepool.core.progress import PROGRESS_ENV, PROGRESS_FILE
from computepool.sdk.progress import progress, write_progress

SRC = str(Path(__file__).resolve().parents[2] / "src")

# The job: whenever the file `next` beside it names a new step count, record it with the SDK and
# say so on stdout; "end" ends it.
JOB = """
import pathlib, time
import computepool
seen = ""
while True:
    text = pathlib.Path("next").read_text() if pathlib.Path("next").exists() else ""
    if text == "end":
        break
    if text and text != seen:
        seen = text
        computepool.progress(int(text.split()[0]))
        print("at", text, flush=True)
    time.sleep(0.01)
"""


def test_the_sdk_writes_the_file_and_refuses_a_bad_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    assert progress(5) is False  # outside the pool: nothing to write, no error
    target = tmp_path / PROGRESS_FILE
    monkeypatch.setenv(PROGRESS_ENV, str(target))
    assert progress(120) is True
    step, at = read_progress(tmp_path) or (None, None)
    assert step == 120 and at is not None and at > 1.7e9
    assert [p.name for p in tmp_path.iterdir()] == [PROGRESS_FILE]  # no temporary file left behind
    for bad in (-1, 1.5, "7", True, None, 2**63):
        with pytest.raises(ValueError, match=r"computepool.progress: step must be a whole number"):
            progress(bad)  # type: ignore[arg-type]
    assert read_progress(tmp_path) == (120, at)  # unchanged by the refused calls


def test_a_running_job_advancing_gives_steps_per_second(executor: Executor, tmp_path: Path) -> None:
    work = executor.work_dir("4101", 1)
    work.mkdir(parents=True)
    env = {PROGRESS_ENV: str(work / PROGRESS_FILE), "PYTHONPATH": SRC}
    rec = executor.start(JobSpec("4101", 1, [sys.executable, "-c", JOB], env=env))
    job = RunningJob(rec.key, "4101", 1, work)
    reader = ProgressReader()
    out = Path(rec.run_dir) / "stdout.log"
    writes = iter(range(100))

    def advance(step: int) -> tuple[int, float]:
        text = f"{step} {next(writes)}"  # a new text each time, so the job writes again
        (work / "next.tmp").write_text(text)
        (work / "next.tmp").rename(work / "next")
        _wait_for(lambda: f"at {text}\n" in out.read_text())
        got = read_progress(work)
        assert got is not None and got[0] == step
        return got

    first = advance(100)
    assert reader.rates([job]) == []  # a first sight: only a base for the next read
    second = advance(400)
    [rate] = reader.rates([job])
    assert rate["allocation_id"] == 4101 and rate["attempt"] == 1
    assert rate["steps_per_s"] == pytest.approx(300 / (second[1] - first[1]))
    assert reader.rates([job]) == []  # no step since: stale, nothing reported
    advance(400)  # written again, the same count: still nothing
    assert reader.rates([job]) == []
    base = advance(250)  # the count went back (started again): a new base, no rate
    assert reader.rates([job]) == []
    third = advance(550)
    assert [r["steps_per_s"] for r in reader.rates([job])] == [pytest.approx(300 / (third[1] - base[1]))]
    (work / "next").write_text("end")
    executor.wait(rec.key, 10)
    assert reader.rates([]) == []  # the ended job is forgotten


def test_links_fifos_and_odd_files_are_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    write_progress(secret, 7, 1.7e9)
    work = tmp_path / "work"
    work.mkdir()
    (work / PROGRESS_FILE).symlink_to(secret)
    assert read_progress(work) is None
    (work / PROGRESS_FILE).unlink()
    os.mkfifo(work / PROGRESS_FILE)  # would block a reader that waited on it
    assert read_progress(work) is None
    (work / PROGRESS_FILE).unlink()
    for text in ("", "[]", '{"step": -1, "time": 1}', '{"step": 1.5, "time": 1}', '{"step": 3}', "x" * 5000):
        (work / PROGRESS_FILE).write_text(text)
        assert read_progress(work) is None, text
    assert read_progress(tmp_path / "missing") is None


def _wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
