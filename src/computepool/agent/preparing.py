"""Getting a job's inputs onto the node off the control loop: code and stdin blobs, container images.

A 2 GiB fetch or a slow `podman pull` on the loop thread would hold up every other job's start and
stop and the node's reports. So the loop asks `Preparer.check(a)` each tick for an attempt it is
about to start: what the attempt still lacks (a blob not in the cache, an image not seen on the
node) goes to a few worker threads, and the attempt waits, "preparing", until a later tick finds it
ready. The start itself stays on the loop thread, and finds its inputs in the caches.

- One task per input: jobs that need the same blob or image share one fetch or pull.
- The workers take tasks from the tenants in turn (the tenant of the attempt that first asked):
  a task may take minutes (an archive of GiBs to unpack, a slow pull), and in one queue a tenant's
  many attempts held every other tenant's starts on the node behind all of theirs.
- Once its code blob is cached, an attempt gets one more task of its own (`unpack`, JobStarter's):
  its run and work dirs made, the archive checked and unpacked there as the tenant, a marker left
  in the run dir — a 2 GiB unpack is as slow as a fetch. The start then finds the code in place.
- A failure fails the start with the reason the start itself would give (`Readiness.failure`).
- An attempt withdrawn while it prepares (`forget`) is dropped, never started; its tasks still end
  and fill the caches, which hurts no one. An unpack not yet begun is skipped; one under way ends,
  and its run dir stays under runs/ like any attempt's (never started, so nothing reports it).
- A restarted agent prepares again what it had not started: cached inputs are found at once, and
  code the marker says is unpacked is not unpacked twice.
- The control plane hears nothing of a preparing attempt: its allocation stays bound.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from computepool.agent.assignment import Assignment
from computepool.agent.blobs import BlobCache
from computepool.agent.launch import Launcher
from computepool.core.tarsafe import is_sha256

log = logging.getLogger("computepool.agent")
DEFAULT_WORKERS = 3


@dataclass
class _Task:
    """One fetch or pull, shared by every attempt that needs it."""

    name: str  # "blob <sha>" or "image <ref>", for the log
    run: Callable[[], None]
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""


@dataclass(frozen=True)
class Readiness:
    """`ready`: start it now (`failure`, when set, is why the start fails); else still preparing."""

    ready: bool
    failure: str = ""


READY = Readiness(True)
PREPARING = Readiness(False)


class _TurnQueue:
    """A queue whose items are taken from its tenants in turn (FIFO within a tenant): the tenant
    served longest ago goes first, so one whose item was just taken waits behind another tenant
    with items, even where its next item arrived first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[str, deque[_Task | None]] = {}
        self._turns: deque[str] = deque()  # the tenants with items, in the order of their next turn
        self._served: dict[str, int] = {}  # when each tenant's item was last taken (a count)
        self._taken = 0

    def put(self, tenant: str, item: _Task | None) -> None:
        with self._cond:
            if tenant not in self._items:
                self._items[tenant] = deque()
                self._turns.append(tenant)
            self._items[tenant].append(item)
            self._cond.notify()

    def get(self) -> _Task | None:
        with self._cond:
            while not self._turns:
                self._cond.wait()
            tenant = min(self._turns, key=lambda t: self._served.get(t, -1))
            self._turns.remove(tenant)
            self._served[tenant], self._taken = self._taken, self._taken + 1
            items = self._items[tenant]
            item = items.popleft()
            if items:
                self._turns.append(tenant)
            else:
                del self._items[tenant]
            return item


class Preparer:
    """Fetches blobs and pulls images for the attempts the loop is about to start, on daemon threads."""

    def __init__(
        self,
        blobs: Callable[[], BlobCache | None],
        launcher: Launcher,
        wake: Callable[[], None],
        workers: int = DEFAULT_WORKERS,
        unpack: Callable[[Assignment], None] | None = None,
    ) -> None:
        """`blobs` answers the agent's BlobCache (None: this agent cannot fetch; the start says so);
        `wake` nudges the loop when a task ends, so that a ready attempt starts at once; `unpack`
        puts an attempt's cached code in its work dir (None: the start unpacks it itself)."""
        self._blobs = blobs
        self._launcher = launcher
        self._wake = wake
        self._workers = max(1, workers)
        self._unpack = unpack
        self._unpacking: set[str] = set()  # job keys whose unpack task was queued
        self._queue = _TurnQueue()
        self._tasks: dict[str, _Task] = {}  # by input, while queued or running
        self._waiting: dict[str, list[_Task]] = {}  # by job key: the tasks the attempt waits for
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def check(self, a: Assignment) -> Readiness:
        """Whether the attempt can start now (loop thread only); starts the tasks it still needs."""
        tasks = self._waiting.get(a.key)
        if tasks is None:
            tasks = [self._task(name, run, a.tenant) for name, run in self._needs(a)]
            if tasks:
                log.info("%s preparing: %s", a.key, ", ".join(t.name for t in tasks))
            self._waiting[a.key] = tasks
        if not all(t.done.is_set() for t in tasks):
            return PREPARING
        failed = next((t.error for t in tasks if t.error), "")
        if not failed and self._unpack_next(a):
            return PREPARING
        del self._waiting[a.key]
        self._unpacking.discard(a.key)
        return Readiness(True, failed)

    def preparing(self) -> set[str]:
        """The keys of the attempts waiting for their inputs."""
        return set(self._waiting)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the attempts no longer wanted here (cancelled, moved, stale): none of them will start."""
        wanted = set(keep)
        for key in [k for k in self._waiting if k not in wanted]:
            del self._waiting[key]
            self._unpacking.discard(key)
            log.info("%s withdrawn while preparing: not started", key)

    def close(self) -> None:
        """Stop the idle workers; one busy with a fetch or pull ends with the process (daemon)."""
        for _ in self._threads:
            self._queue.put("", None)

    # ---- what an attempt needs ----------------------------------------------------------------

    def _needs(self, a: Assignment) -> list[tuple[str, Callable[[], None]]]:
        needs: list[tuple[str, Callable[[], None]]] = []
        cache = self._blobs()
        if cache is not None:
            for sha, what in ((a.code, "code"), (a.stdin, "stdin")):
                # a malformed sha is refused by the start itself, without any I/O
                if sha and is_sha256(sha) and not cache.path(sha).is_file():
                    needs.append((f"blob {sha}", _fetcher(cache, sha, what)))
        launcher = self._launcher  # a container job's image: as `Launcher.prepare` would get it
        sandboxed = launcher.sandbox is not None and launcher.host is not None
        image = a.image if sandboxed and a.command and a.tenant else None
        if image and not launcher.container_engine().image_known(image, a.image_digest):
            needs.append((f"image {image}", _puller(launcher, image, a.image_digest)))
        return needs

    def _unpack_next(self, a: Assignment) -> bool:
        """Queue the attempt's unpack once its inputs are here; whether it now waits for it."""
        unpack = self._unpack
        if unpack is None or not a.code or not is_sha256(a.code) or a.key in self._unpacking:
            return False
        if self._blobs() is None:
            return False  # the start says why it cannot have its code
        self._unpacking.add(a.key)

        def run() -> None:
            if a.key in self._waiting:  # else withdrawn before its turn: nothing made on disk
                unpack(a)

        task = self._task(f"unpack {a.key}", run, a.tenant)
        self._waiting[a.key] = [task]
        log.info("%s preparing: %s", a.key, task.name)
        return True

    def _task(self, name: str, run: Callable[[], None], tenant: str) -> _Task:
        with self._lock:
            task = self._tasks.get(name)
            if task is not None:
                return task  # already queued or running: shared
            task = self._tasks[name] = _Task(name, run)
            if len(self._threads) < self._workers:
                t = threading.Thread(
                    target=self._work, name=f"cpool-prepare-{len(self._threads)}", daemon=True
                )
                self._threads.append(t)
                t.start()
        self._queue.put(tenant, task)
        return task

    def _work(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            try:
                task.run()
            except Exception as e:  # the message is the job's reason, as the start would give it
                task.error = str(e)
                log.warning("preparing %s failed: %s", task.name, e)
            finally:
                with self._lock:
                    self._tasks.pop(task.name, None)
                task.done.set()
                self._wake()


def _fetcher(cache: BlobCache, sha: str, what: str) -> Callable[[], None]:
    def fetch() -> None:
        cache.fetch(sha, what)

    return fetch


def _puller(launcher: Launcher, image: str, digest: str | None) -> Callable[[], None]:
    def pull() -> None:
        podman = launcher.container_engine()
        if podman.available()[0]:  # else the start says why containers cannot run here
            podman.ensure_image(image, digest)

    return pull
