"""Blobs on the node: the code and stdin a job ships with, and the files a user asks back.

- `BlobCache` fetches a blob through the node's own credential (`GET /blobs/{sha}`: the server
  lets a node read only what its live work names), checks its hash and keeps it by hash in
  `DATA_DIR/blobs` (root 0700), so the same code is fetched once per node.
- `unpack_code` unpacks a code archive into a job's fresh work dir, refusing absolute paths,
  `..`, links out of the tree and special files (core/tarsafe.py); the launcher then hands every
  file to the tenant's user with the rest of `work/`.
- `FileAnswerer` answers file requests: the path is packed with GNU tar run AS THE TENANT'S USER
  (so it reads nothing the job could not), links leading out are refused, and the tar.gz goes
  back to the control plane as a blob of the tenant — or the reason it could not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import queue
import shutil
import subprocess
import tarfile
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from computepool.agent.api import AgentApi, ApiError, Unreachable
from computepool.agent.sandbox import FIXED_PATH
from computepool.agent.tenants import user_name
from computepool.core.tarsafe import UnsafeArchive, check_members, is_sha256, safe_extract, sha256_hex

log = logging.getLogger("computepool.agent")
CACHE_DIR = "blobs"
STDIN_FILE = "stdin"
MAX_UNPACKED = 64 << 30  # a code archive may not unpack to more than this (a gzip bomb stops here)
MAX_PACKED = 4 << 30  # what the agent packs before the server's own cap refuses it


class CodeUnavailable(ValueError):
    """The job's code or stdin could not be fetched or unpacked; the message is the job's reason."""


class BlobCache:
    """Blobs fetched by this node, kept by hash (root only)."""

    def __init__(self, data_dir: Path, api: AgentApi) -> None:
        self.dir = data_dir / CACHE_DIR
        self.api = api
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

    def unpack_code(self, sha: str, work_dir: Path) -> int:
        """Unpack the code blob into `work_dir`; the number of entries. Raises CodeUnavailable."""
        data = self.fetch(sha, "code").read_bytes()
        try:
            return len(safe_extract(data, work_dir, max_bytes=MAX_UNPACKED))
        except UnsafeArchive as e:
            raise CodeUnavailable(f"code: refused the archive: {e}") from None

    def stdin_file(self, sha: str, run_dir: Path) -> Path:
        """A copy of the stdin blob in the run dir (root's, read by the job's wrapper)."""
        src = self.fetch(sha, "stdin")
        dest = run_dir / STDIN_FILE
        shutil.copyfile(src, dest)
        os.chmod(dest, 0o600)
        return dest


# --- file requests ------------------------------------------------------------------------------
def _inside(root: Path, rel: str) -> Path:
    """`root/rel` if it stays in `root` once links are followed; raises ValueError with the reason."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts:
        raise ValueError(f"{rel}: must be a path inside the job's work dir")
    target = root / p
    real_root = os.path.realpath(root)
    real = os.path.realpath(target)
    if real != real_root and not real.startswith(real_root + os.sep):
        raise ValueError(f"{rel}: leads outside the job's work dir")
    if not os.path.lexists(target):
        raise ValueError(f"{rel}: no such file or directory in the job's work dir")
    return target


def pack_as(user: pwd.struct_passwd | None, work_dir: Path, rel: str, out: Path) -> None:
    """`tar -czf OUT -C WORK REL` as `user` (None: the agent's own user); raises ValueError."""
    tar = shutil.which("tar", path=FIXED_PATH)
    if tar is None:
        raise ValueError("GNU tar is not installed on the node")
    as_root = os.geteuid() == 0 and user is not None
    with out.open("wb") as f:
        try:
            r = subprocess.run(
                [tar, "--create", "--gzip", "--file", "-", "--directory", str(work_dir), "--", rel],
                stdout=f,
                stderr=subprocess.PIPE,
                env={"PATH": FIXED_PATH, "LANG": "C.UTF-8"},
                user=user.pw_uid if as_root and user else None,
                group=user.pw_gid if as_root and user else None,
                extra_groups=[] if as_root else None,
                timeout=600,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ValueError(f"{rel}: packing took over 10 minutes") from None
    if r.returncode not in (0, 1):  # 1: a file changed while read (the job still writes): still sent
        why = r.stderr.decode(errors="replace").strip().splitlines()
        raise ValueError(f"{rel}: {why[-1] if why else f'tar exited {r.returncode}'}")
    if out.stat().st_size > MAX_PACKED:
        raise ValueError(f"{rel}: over {MAX_PACKED >> 20} MiB packed")


class FileAnswerer:
    """Packs and sends the files users ask for, one request at a time, on its own thread."""

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
        self._queue: queue.Queue[Mapping[str, Any] | None] = queue.Queue()
        self._busy: set[int] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, requests: Iterable[Mapping[str, Any]]) -> None:
        for req in requests:
            rid = int(req.get("id") or 0)
            with self._lock:
                if rid <= 0 or rid in self._busy:
                    continue
                self._busy.add(rid)
            self._queue.put(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cpool-files", daemon=True)
                self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while True:
            req = self._queue.get()
            if req is None:
                return
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
                _inside(work, rel)
                pack_as(self.run_as(tenant), work, rel, out)
                with out.open("rb") as f, tarfile_open(f) as tar:
                    check_members(tar)
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


def tarfile_open(f: BinaryIO) -> tarfile.TarFile:
    try:
        return tarfile.open(fileobj=f, mode="r:gz")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise UnsafeArchive(f"unreadable archive: {e}") from None


def tenant_user(tenant: str) -> pwd.struct_passwd | None:
    """The tenant's Unix user on this node (None when jobs do not run as one here)."""
    if os.geteuid() != 0 or not tenant:
        return None
    try:
        return pwd.getpwnam(user_name(tenant))
    except (KeyError, ValueError):
        return None
