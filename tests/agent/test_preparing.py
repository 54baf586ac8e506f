"""The preparation stage on its own: what an attempt waits for, one fetch shared, how a failure
reads, withdrawal. The control plane is a loopback port that accepts and never answers until the
test closes it; the whole path (real server, agent, a held fetch or pull) is in
tests/e2e/test_preparing_e2e.py.
"""

from __future__ import annotations

import contextlib
import io
import logging
import socket
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from computepool.agent.api import AgentApi
from computepool.agent.assignment import Assignment
from computepool.agent.blobs import BlobCache
from computepool.agent.executor import Executor
from computepool.agent.jobstart import CODE_MARKER, JobStarter
from computepool.agent.preparing import PREPARING, READY, Preparer, Readiness
from computepool.core.tarsafe import sha256_hex


class Silent:
    """A loopback port that accepts and never answers: a fetch from it waits until `close`, then fails."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.conns.append(self.sock.accept()[0])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for c in self.conns:
            c.close()


def assignment(alloc: str, **kw: object) -> Assignment:
    base: dict[str, object] = dict(
        allocation_id=alloc, attempt=1, term=1, tenant="t", slices=[], command=["true"], env={},
        isolation="", cpu_milli=0, memory_mib=0,
    )  # fmt: skip
    return Assignment(**{**base, **kw})


@pytest.fixture
def silent() -> Iterator[Silent]:
    server = Silent()
    yield server
    server.close()


@pytest.fixture
def setup(executor: Executor, tmp_path: Path, silent: Silent) -> tuple[Preparer, BlobCache, threading.Event]:
    cache = BlobCache(tmp_path / "agent", AgentApi(silent.url, timeout_s=5))
    woken = threading.Event()
    return Preparer(lambda: cache, executor.launcher, woken.set), cache, woken


def test_nothing_to_fetch_is_ready_at_once(setup: tuple[Preparer, BlobCache, threading.Event]) -> None:
    prep, cache, _ = setup
    assert prep.check(assignment("1")) == READY
    held = b"already here"
    sha = sha256_hex(held)
    cache.dir.mkdir(parents=True)
    cache.path(sha).write_bytes(held)
    assert prep.check(assignment("2", code=sha, stdin=sha)) == READY
    # not a sha256: no fetch is tried; the start refuses it with its own reason
    assert prep.check(assignment("3", code="nope")) == READY
    # an image where jobs are not sandboxed: nothing to pull (no containers here)
    assert prep.check(assignment("4", image="localhost/x:1")) == READY
    assert prep.preparing() == set()


def test_one_fetch_shared_and_its_failure_reads_like_the_start(
    setup: tuple[Preparer, BlobCache, threading.Event], silent: Silent, caplog: pytest.LogCaptureFixture
) -> None:
    prep, _, woken = setup
    sha = sha256_hex(b"never arrives")
    a, b, gone = (assignment(str(i), code=sha) for i in (1, 2, 3))
    with caplog.at_level(logging.INFO, logger="computepool.agent"):
        assert prep.check(a) == prep.check(b) == prep.check(gone) == PREPARING
        wait(lambda: silent.conns)
        time.sleep(0.3)
        assert prep.check(a) == PREPARING  # held by the silent control plane
        assert len(silent.conns) == 1  # one fetch for the three attempts
        prep.forget([a.key, b.key])  # `gone` was withdrawn: it is never answered ready
        assert prep.preparing() == {a.key, b.key}
        silent.close()
        assert woken.wait(30), "the loop is woken when a task ends"
        ra, rb = prep.check(a), prep.check(b)
    assert ra == rb and ra.ready
    assert ra.failure.startswith(f"code: could not fetch blob {sha[:16]}"), ra.failure
    assert sum(f"preparing blob {sha} failed" in r.getMessage() for r in caplog.records) == 1
    assert prep.preparing() == set()
    assert any(f"{gone.key} withdrawn while preparing" in r.getMessage() for r in caplog.records)
    # a failure is not kept: the next attempt needing the blob fetches again
    assert prep.check(assignment("4", code=sha)) == PREPARING
    prep.close()


def tgz(members: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def test_code_is_unpacked_on_a_worker_once_and_a_withdrawn_unpack_never_begins(
    executor: Executor, tmp_path: Path, silent: Silent
) -> None:
    cache = BlobCache(tmp_path / "agent", AgentApi(silent.url, timeout_s=5))
    starter = JobStarter("n", None, executor, tmp_path / "agent", None)  # type: ignore[arg-type,unused-ignore]
    starter.blobs = cache
    woken = threading.Event()
    prep = Preparer(lambda: cache, executor.launcher, woken.set, workers=1, unpack=starter.unpack)
    good = tgz({"hello.txt": b"hi"})
    cache.dir.mkdir(parents=True)
    cache.path(sha256_hex(good)).write_bytes(good)
    a = assignment("1", code=sha256_hex(good))
    assert prep.check(a) == PREPARING  # cached, but not yet unpacked
    assert woken.wait(20)
    wait(lambda: prep.check(a) != PREPARING)
    assert prep.preparing() == set()
    run_dir = executor.run_dir("1", 1)
    assert (executor.work_dir("1", 1) / "hello.txt").read_bytes() == b"hi"
    assert (run_dir / CODE_MARKER).read_text() == a.code
    (executor.work_dir("1", 1) / "hello.txt").write_bytes(b"the job's own")
    assert starter._shipped(a, run_dir, executor.work_dir("1", 1)) is None  # found done: not again
    assert (executor.work_dir("1", 1) / "hello.txt").read_bytes() == b"the job's own"
    # the one worker is held by a fetch: an unpack queued behind it and then withdrawn never begins
    held = assignment("3", code=sha256_hex(b"never arrives"))
    gone = assignment("4", code=a.code)
    assert prep.check(held) == prep.check(gone) == PREPARING
    wait(lambda: silent.conns)
    assert prep.check(gone) == PREPARING
    prep.forget([held.key])
    silent.close()
    wait(lambda: prep.check(held) != PREPARING, 30)
    time.sleep(0.5)  # the skipped unpack has had its turn on the one worker
    assert not executor.run_dir("4", 1).exists()
    prep.close()


def test_a_refused_archive_fails_the_attempt_with_the_start_reason(
    executor: Executor, tmp_path: Path
) -> None:
    cache = BlobCache(tmp_path / "agent", AgentApi("http://127.0.0.1:9", timeout_s=5))
    starter = JobStarter("n", None, executor, tmp_path / "agent", None)  # type: ignore[arg-type,unused-ignore]
    starter.blobs = cache
    prep = Preparer(lambda: cache, executor.launcher, lambda: None, unpack=starter.unpack)
    bad = tgz({"../out.txt": b"x"})
    cache.dir.mkdir(parents=True)
    cache.path(sha256_hex(bad)).write_bytes(bad)
    b = assignment("2", code=sha256_hex(bad))
    ready = prep.check(b)
    deadline = time.monotonic() + 20
    while ready == PREPARING:
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
        ready = prep.check(b)
    assert isinstance(ready, Readiness) and ready.ready
    assert ready.failure.startswith("code: refused the archive:"), ready.failure
    assert not (executor.run_dir("2", 1) / CODE_MARKER).exists()
    prep.close()


def wait(check: Callable[[], object], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
