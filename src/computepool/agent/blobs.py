"""Blobs on the node: the code and stdin a job ships with, and the files a user asks back.

- `BlobCache` fetches a blob through the node's own credential (`GET /blobs/{sha}`: the server
  lets a node read only what its live work names), checks its hash and keeps it by hash in
  `DATA_DIR/blobs` (root 0700), so the same code is fetched once per node.
- `unpack_code` checks a code archive as a stream (core/tarsafe.py: no absolute paths, `..`, links
  out or through links, special files; member and byte caps), then unpacks its re-write (exactly
  the members checked) into the job's fresh work dir with GNU tar run AS THE TENANT'S USER
  (agent/jobfiles.py), never as root.
- `FileAnswerer` answers file requests: the path is walked from the work dir one name at a time,
  never through a link (a job swapping links in cannot lead it out), and packed with GNU tar run
  AS THE TENANT'S USER (so it reads nothing the job could not); the tar.gz goes back to the control
  plane as a blob of the tenant — or the reason it could not. Links in it that lead out are left
  out by the client.
- Cached blobs no job used for a day are dropped (`prune`), checked at most every ten minutes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import queue
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from computepool.agent.api import AgentApi, ApiError, Unreachable
from computepool.agent.jobfiles import pack_as, unpack_as
from computepool.agent.sandbox import SandboxConfig
from computepool.agent.tenants import USER_PREFIX, TenantUserError, ensure_tenant_user, user_name
from computepool.core.errors import InvalidInput
from computepool.core.tarsafe import UnsafeArchive, canonical, check_stream, is_sha256, sha256_hex

log = logging.getLogger("computepool.agent")
CACHE_DIR = "blobs"
STDIN_FILE = "stdin"
MAX_UNPACKED = 8 << 30  # by default a code archive may not unpack to more than this (`--code-max-gib`)
PRUNE_AFTER_S = 24 * 3600  # a cached blob no job used for this long is dropped
PRUNE_EVERY_S = 600.0
MAX_PACKED = 4 << 30  # what the agent packs before the server's own cap refuses it


class CodeUnavailable(ValueError):
    """The job's code or stdin could not be fetched or unpacked; the message is the job's reason."""


class BlobCache:
    """Blobs fetched by this node, kept by hash (root only)."""

    def __init__(
        self,
        data_dir: Path,
        api: AgentApi,
        *,
        sandbox: SandboxConfig | None = None,
        max_unpacked: int = MAX_UNPACKED,
    ) -> None:
        """`sandbox`: the executor's; where set on a root agent, code is unpacked as the tenant's user."""
        self.dir = data_dir / CACHE_DIR
        self.api = api
        self.sandbox = sandbox
        self.max_unpacked = max_unpacked
        self.max_age_s = PRUNE_AFTER_S
        self._pruned_at = 0.0
        self._lock = threading.Lock()  # guards `_fetching`
        self._fetching: dict[str, threading.Lock] = {}  # one fetch per sha; others wait for it

    def path(self, sha: str) -> Path:
        return self.dir / sha

    def fetch(self, sha: str, what: str) -> Path:
        """The blob's file in the cache, fetched first if missing. Raises CodeUnavailable."""
        if not is_sha256(sha):
            raise CodeUnavailable(f"{what}: {sha!r} is not a sha256")
        path = self.path(sha)
        if path.is_file():  # cached: no lock, so a slow fetch of another blob holds up nothing here
            return path
        with self._lock:
            one = self._fetching.setdefault(sha, threading.Lock())
        with one:
            if path.is_file():  # fetched while this thread waited
                return path
            try:
                data = self.api.get_bytes(f"/blobs/{sha}")
            except (Unreachable, ApiError) as e:
                raise CodeUnavailable(f"{what}: could not fetch blob {sha[:16]}…: {e}") from None
            if sha256_hex(data) != sha:
                raise CodeUnavailable(f"{what}: blob {sha[:16]}… arrived with other bytes")
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.dir, 0o700)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".fetch-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return path

    def unpack_code(self, sha: str, work_dir: Path, tenant: str = "") -> int:
        """Unpack the code blob into `work_dir` as the tenant's user (see `code_user`); the number of
        entries. Raises CodeUnavailable."""
        user = self.code_user(tenant)
        path = self._use(sha, "code")
        try:
            with path.open("rb") as f:
                verdict = check_stream(f, max_bytes=self.max_unpacked)
                f.seek(0)
                with canonical(f, verdict) as tar:  # tar reads the members checked, re-written
                    unpack_as(user, tar, work_dir, self.max_unpacked)
        except UnsafeArchive as e:
            raise CodeUnavailable(f"code: refused the archive: {e}") from None
        except (ValueError, OSError) as e:
            raise CodeUnavailable(f"code: {e}") from None
        self.prune()
        return verdict.members

    def code_user(self, tenant: str) -> pwd.struct_passwd | None:
        """Who unpacks: the tenant's user on a sandboxing root agent (made if missing, as the
        launcher would), else the agent's own user — whose jobs run as it anyway."""
        if self.sandbox is None or os.geteuid() != 0:
            return None
        try:
            return ensure_tenant_user(tenant, self.sandbox.uid_range, self.sandbox.user_prefix)
        except (TenantUserError, InvalidInput) as e:
            raise CodeUnavailable(f"code: {e}") from None

    def stdin_file(self, sha: str, run_dir: Path) -> Path:
        """A copy of the stdin blob in the run dir (root's, read by the job's wrapper)."""
        src = self._use(sha, "stdin")
        dest = run_dir / STDIN_FILE
        shutil.copyfile(src, dest)
        os.chmod(dest, 0o600)
        self.prune()
        return dest

    def _use(self, sha: str, what: str) -> Path:
        """The blob's cached file, marked used now (so `prune` keeps it); fetched again if a prune
        took it between the fetch and this use."""
        for _ in range(2):
            path = self.fetch(sha, what)
            try:
                os.utime(path)
            except FileNotFoundError:
                continue
            return path
        raise CodeUnavailable(f"{what}: blob {sha[:16]}… vanished from the cache")

    def prune(self, now: float | None = None) -> int:
        """Drop cached blobs (and stray partial fetches) unused for `max_age_s`; how many went.

        A job needs its blob only until it has started (code unpacked, stdin copied), and each use
        marks the blob, so an old one is no live job's. Runs at most every PRUNE_EVERY_S."""
        now = time.time() if now is None else now
        if now - self._pruned_at < PRUNE_EVERY_S:
            return 0
        self._pruned_at = now
        gone = 0
        try:
            entries = list(os.scandir(self.dir))
        except FileNotFoundError:
            return 0
        for entry in entries:
            if not (is_sha256(entry.name) or entry.name.startswith(".fetch-")):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and now - st.st_mtime > self.max_age_s:
                    os.unlink(entry.path)
                    gone += 1
            except FileNotFoundError:
                continue
        if gone:
            log.info("blob cache: dropped %d blob(s) unused for %.0f h", gone, self.max_age_s / 3600)
        return gone


# --- file requests ------------------------------------------------------------------------------
class FileAnswerer:
    """Packs and sends the files users ask for, one request of a tenant at a time, each tenant on a
    thread of its own (made while it has requests waiting): packing one request may take minutes
    (tar's ten minutes of CPU: 4 TiB of a sparse file's zeros gzip to almost nothing), and in one
    queue for the node a tenant's few such requests held every other tenant's `cpool cp` for hours."""

    def __init__(
        self,
        api: AgentApi,
        data_dir: Path,
        work_dir_of: Callable[[str, int], Path],
        run_as: Callable[[str], pwd.struct_passwd | None],
    ) -> None:
        self.api = api
        self.tmp_dir = data_dir / CACHE_DIR / "out"
        self.work_dir_of = work_dir_of
        self.run_as = run_as
        self._queues: dict[str, queue.SimpleQueue[Mapping[str, Any]]] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, requests: Iterable[Mapping[str, Any]]) -> None:
        for req in requests:
            rid, tenant = int(req.get("id") or 0), str(req.get("tenant") or "")
            with self._lock:
                if rid <= 0 or rid in self._busy or self._closed:
                    continue
                self._busy.add(rid)
                self._queues.setdefault(tenant, queue.SimpleQueue()).put(req)
                if tenant not in self._threads:
                    t = threading.Thread(target=self._run, args=(tenant,), name="cpool-files", daemon=True)
                    self._threads[tenant] = t
                    t.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads.values())
        end = time.monotonic() + 2.0
        for t in threads:
            t.join(timeout=max(0.0, end - time.monotonic()))

    def _next(self, tenant: str) -> Mapping[str, Any] | None:
        """The tenant's next request; None (its thread then ends) when none waits or on close."""
        with self._lock:
            q = self._queues[tenant]
            if self._closed or q.empty():
                del self._queues[tenant], self._threads[tenant]
                return None
            return q.get_nowait()

    def _run(self, tenant: str) -> None:
        while (req := self._next(tenant)) is not None:
            try:
                self.answer(req)
            except Exception as e:  # the agent outlives whatever one request does
                log.error("file request %s: %s", req.get("id"), e)
            finally:
                with self._lock:
                    self._busy.discard(int(req.get("id") or 0))

    def answer(self, req: Mapping[str, Any]) -> None:
        rid, rel = int(req["id"]), str(req["path"])
        alloc, attempt, tenant = str(req["allocation_id"]), int(req["attempt"]), str(req.get("tenant") or "")
        self.tmp_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, name = tempfile.mkstemp(dir=self.tmp_dir, prefix=f"{rid}-", suffix=".tar.gz")
        os.close(fd)
        out = Path(name)
        try:
            try:
                work = self.work_dir_of(alloc, attempt)
                if not work.is_dir():
                    raise ValueError(f"the job's directory is gone from this node (attempt {attempt})")
                pack_as(self.run_as(tenant), work, rel, out, MAX_PACKED)
                with out.open("rb") as f:
                    check_stream(f, links_out="skip")  # links out: the client leaves them out, saying so
            except UnsafeArchive as e:
                self._failed(rid, f"refused: {e}")
                return
            except (ValueError, OSError) as e:
                self._failed(rid, str(e))
                return
            try:
                with out.open("rb") as f:
                    self.api.put_file(f"/nodes/{self.api.name}/files/{rid}", f)
            except ApiError as e:  # refused (not a network failure, which the next poll retries)
                self._failed(rid, e.message)
                return
            log.info(
                "file request %d: sent %s of %s/%d (%d bytes)", rid, rel, alloc, attempt, out.stat().st_size
            )
        finally:
            out.unlink(missing_ok=True)

    def _failed(self, rid: int, why: str) -> None:
        with contextlib.suppress(ApiError):
            self.api.post_json(f"/nodes/{self.api.name}/files/{rid}/failed", {"error": why[:1000]})
        log.info("file request %d failed: %s", rid, why)


def tenant_user(tenant: str, prefix: str = USER_PREFIX) -> pwd.struct_passwd | None:
    """The tenant's Unix user on a root agent (None when not root: it packs as itself). Raises
    ValueError when there is none: the files are then not read at all, never as root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(user_name(tenant, prefix))
    except (KeyError, ValueError):
        raise ValueError(
            f"tenant {tenant!r} has no Unix user on this node; its files are not read as root"
        ) from None
