"""Writing into and reading out of a job's work dir without the agent's root rights.

The work dir's contents are the tenant's (its code archive, what its job wrote), so the agent never
walks or writes them as root: GNU tar runs AS THE TENANT'S USER (no supplementary groups, a file
size limit through util-linux `prlimit`, a time limit), and the kernel's permissions bound what it
can touch whatever the archive holds. The work dir is handed to tar as a descriptor the agent
opened (`--directory /proc/self/fd/N`), so tar reaches it even where the tenant may not pass the
agent's data dir (a root agent's `~/.computepool`, 0700). The one file the agent itself puts there
(the CA copy of a function worker) is created with O_NOFOLLOW|O_EXCL, never through a link.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from computepool.agent.sandbox import FIXED_PATH

TAR_TIMEOUT_S = 600
TAR_CPU_S = 600
_ENV = {"PATH": FIXED_PATH, "LANG": "C.UTF-8"}


@contextlib.contextmanager
def dir_fd(path: Path) -> Iterator[int]:
    """An open descriptor of the directory `path` itself (never of what a link there points to)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def _tools() -> tuple[str, str]:
    tar, prlimit = shutil.which("tar", path=FIXED_PATH), shutil.which("prlimit", path=FIXED_PATH)
    if tar is None:
        raise ValueError("GNU tar is not installed on the node")
    if prlimit is None:
        raise ValueError("prlimit (util-linux) is not installed on the node")
    return tar, prlimit


def _first_error(stderr: bytes, rc: int) -> str:
    lines = [line.strip() for line in stderr.decode(errors="replace").splitlines() if line.strip()]
    if rc < 0:
        return f"tar was killed by signal {-rc}" + (" (a file over the size cap)" if rc == -25 else "")
    return re.sub(r"^/\S*/tar: ", "tar: ", lines[0]) if lines else f"tar exited {rc}"


def run_tar(
    user: pwd.struct_passwd | None,
    work_fd: int,
    args: list[str],
    *,
    stdin: int | None = None,
    stdout: int | None = None,
    max_file_bytes: int | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """`tar --directory /proc/self/fd/WORK ARGS` as `user` (None: the agent's own user).

    Raises ValueError when it could not run or ran out of time."""
    tar, prlimit = _tools()
    as_other = os.geteuid() == 0 and user is not None
    limits = [f"--cpu={TAR_CPU_S}"] + ([f"--fsize={max_file_bytes}"] if max_file_bytes else [])
    argv = [prlimit, *limits, "--", tar, "--directory", f"/proc/self/fd/{work_fd}", *args]
    try:
        return subprocess.run(
            argv,
            stdin=stdin if stdin is not None else subprocess.DEVNULL,
            stdout=stdout if stdout is not None else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=dict(_ENV),
            cwd="/",
            pass_fds=(work_fd,),
            user=user.pw_uid if as_other and user else None,
            group=user.pw_gid if as_other and user else None,
            extra_groups=[] if as_other else None,
            umask=0o022,
            timeout=TAR_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ValueError(f"tar took over {TAR_TIMEOUT_S} s") from None
    except OSError as e:
        raise ValueError(f"could not run tar: {e}") from None


def _compression(head: bytes) -> list[str]:
    """tar's option for the archive's compression (it guesses only for files it opens itself)."""
    for magic, option in ((b"\x1f\x8b", "--gzip"), (b"BZh", "--bzip2"), (b"\xfd7zXZ\x00", "--xz")):
        if head.startswith(magic):
            return [option]
    return []


def unpack_as(user: pwd.struct_passwd | None, archive: Path, work_dir: Path, max_bytes: int) -> None:
    """Unpack `archive` (root's file, read through stdin) into `work_dir` as `user`, which is first
    given the work dir. Raises ValueError with tar's first complaint."""
    with dir_fd(work_dir) as wfd, archive.open("rb") as src:
        if os.geteuid() == 0 and user is not None:
            os.fchown(wfd, user.pw_uid, user.pw_gid)
            os.fchmod(wfd, 0o700)
        head = os.pread(src.fileno(), 6, 0)  # tar reads the descriptor from its start
        r = run_tar(
            user,
            wfd,
            ["--extract", *_compression(head), "--file", "-", "--no-same-owner", "--no-same-permissions",
             "--no-overwrite-dir", "--warning=no-timestamp"],
            stdin=src.fileno(),
            max_file_bytes=max_bytes,
        )  # fmt: skip
    if r.returncode != 0:
        raise ValueError(f"unpacking failed: {_first_error(r.stderr, r.returncode)}")


def pack_as(
    user: pwd.struct_passwd | None, work_dir: Path, rel: str, out: Path, max_bytes: int | None = None
) -> None:
    """`tar -czf OUT REL` in `work_dir` as `user` (None: the agent's own user); raises ValueError
    with tar's first complaint. `max_bytes` bounds the archive written (the file-size limit of tar and
    its gzip): a job that wrote 100 GiB is refused there, not packed whole first."""
    with dir_fd(work_dir) as wfd, out.open("wb") as f:
        # --hard-dereference: a file with two names travels twice, never as a hard link (refused)
        args = ["--create", "--gzip", "--hard-dereference", "--file", "-", "--", rel]
        r = run_tar(user, wfd, args, stdout=f.fileno(), max_file_bytes=max_bytes)
    if max_bytes is not None and out.stat().st_size >= max_bytes:
        raise ValueError(f"{rel}: more than {max_bytes >> 20} MiB packed, more than a fetch carries")
    if r.returncode not in (0, 1):  # 1: a file changed while read (the job still writes): still sent
        raise ValueError(f"{rel}: {_first_error(r.stderr, r.returncode)}")


def write_job_file(work_dir: Path, name: str, data: bytes, mode: int = 0o644) -> Path:
    """`work_dir/name` holding `data`, made afresh: whatever the job's files put at that name (a link
    to a file of the host, say) is removed, never followed. Raises OSError (a directory there)."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r}: a plain file name is needed")
    with dir_fd(work_dir) as wfd:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=wfd)
        fd = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=wfd
        )
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), mode)
    return work_dir / name
