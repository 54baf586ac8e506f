"""Writing into and reading out of a job's work dir without the agent's root rights.

The work dir's contents are the tenant's (its code archive, what its job wrote), so the agent never
walks or writes them as root: GNU tar runs AS THE TENANT'S USER (no supplementary groups, a file
size limit through util-linux `prlimit`, a time limit), and the kernel's permissions bound what it
can touch whatever the archive holds. The work dir is handed to tar as a descriptor the agent
opened (`--directory /proc/self/fd/N`), so tar reaches it even where the tenant may not pass the
agent's data dir (a root agent's `~/.computepool`, 0700). The one file the agent itself puts there
(the CA copy of a function worker) is created with O_NOFOLLOW|O_EXCL, never through a link.

A path asked back (`pack_as`) is walked one name at a time from the work dir's descriptor, each
directory opened with O_NOFOLLOW (`open_beneath`): a link on the way is refused, and the job cannot
swap one in afterwards (renameat2 RENAME_EXCHANGE), since tar then starts from the directory that
was opened and is given the last name alone, which it opens with O_NOFOLLOW, as every name below.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import re
import shutil
import stat
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from computepool.agent.sandbox import FIXED_PATH

TAR_TIMEOUT_S = 600
TAR_CPU_S = 600
_ENV = {"PATH": FIXED_PATH, "LANG": "C.UTF-8"}
NICEST = 19  # tar's niceness: it yields the CPU to every job


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


def _lowest_priority() -> list[str]:
    """`nice -n 19` (coreutils) before tar: packing and unpacking run on the node outside any job's
    cgroup, so a tenant asking for a huge sparse file again and again would take CPU from every
    job there; at the lowest priority tar gets only what the jobs leave idle."""
    nice = shutil.which("nice", path=FIXED_PATH)
    return [nice, "-n", str(NICEST)] if nice is not None else []


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
    work = f"/proc/self/fd/{work_fd}"
    argv = [prlimit, *limits, "--", *_lowest_priority(), tar, "--directory", work, *args]
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


def _feed(src: BinaryIO, fd: int, failed: list[Exception]) -> None:
    """Copy `src` into the pipe `fd` (closed at the end); what reading `src` raised goes to `failed`."""
    try:
        while chunk := src.read(1 << 16):
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
    except BrokenPipeError:
        pass  # tar stopped reading: its own complaint says why
    except Exception as e:  # the re-write's refusal (the archive changed): raised once tar is done
        failed.append(e)
    finally:
        os.close(fd)


def unpack_as(user: pwd.struct_passwd | None, tar: BinaryIO, work_dir: Path, max_bytes: int) -> None:
    """Unpack the plain tar read from `tar` (core/tarsafe.canonical: the checked archive as re-written
    by the checker, never the upload itself) into `work_dir` as `user`, which is first given the
    work dir. tar reads it through a pipe and stops at its end marker (no --ignore-zeros). Raises
    ValueError with tar's first complaint, or what reading `tar` raised."""
    with dir_fd(work_dir) as wfd:
        if os.geteuid() == 0 and user is not None:
            os.fchown(wfd, user.pw_uid, user.pw_gid)
            os.fchmod(wfd, 0o700)
        read_end, write_end = os.pipe()
        failed: list[Exception] = []
        feeder = threading.Thread(target=_feed, args=(tar, write_end, failed), name="tar-feed", daemon=True)
        feeder.start()
        try:
            r = run_tar(
                user,
                wfd,
                ["--extract", "--file", "-", "--no-same-owner", "--no-same-permissions",
                 "--no-overwrite-dir", "--warning=no-timestamp"],
                stdin=read_end,
                max_file_bytes=max_bytes,
            )  # fmt: skip
        finally:
            os.close(read_end)  # a feeder still writing gets EPIPE once tar is gone
            feeder.join()
    if failed:
        raise failed[0]
    if r.returncode != 0:
        raise ValueError(f"unpacking failed: {_first_error(r.stderr, r.returncode)}")


@dataclass(frozen=True)
class Beneath:
    """Where a path of the job's ends up: `name` in the directory open as `dir_fd` (O_PATH)."""

    dir_fd: int
    name: str  # one name, or "." for the work dir itself
    prefix: str  # the directories walked through ("out/run1/"), as the archive names them


@contextlib.contextmanager
def open_beneath(work_fd: int, rel: str) -> Iterator[Beneath]:
    """The directory holding `rel`'s last name, reached from `work_fd` one name at a time, never
    through a link (each opened O_PATH|O_NOFOLLOW|O_DIRECTORY, relative to the one before). Raises
    ValueError for an absolute path, `..`, a link or a file on the way, or a last name not there."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts:
        raise ValueError(f"{rel}: must be a path inside the job's work dir")
    *dirs, last = p.parts or (".",)
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
    opened: list[int] = []
    try:
        at = work_fd
        for i, name in enumerate(dirs):
            try:
                at = os.open(name, flags, dir_fd=at)
            except OSError as e:
                raise ValueError(f"{rel}: {_why_not(e, at, name, '/'.join(dirs[: i + 1]), rel)}") from None
            opened.append(at)
        if last != ".":
            try:
                os.stat(last, dir_fd=at, follow_symlinks=False)
            except OSError as e:
                raise ValueError(f"{rel}: {_why_not(e, at, last, rel, rel)}") from None
        yield Beneath(at, last, "".join(f"{d}/" for d in dirs))
    finally:
        for fd in opened:
            os.close(fd)


def _why_not(e: OSError, at: int, name: str, shown: str, rel: str) -> str:
    """Why `shown` (a part of `rel`, `name` in `at`) could not be walked, in words."""
    if e.errno == errno.ENOENT:
        return "no such file or directory in the job's work dir" + ("" if shown == rel else f" ({shown})")
    if e.errno == errno.ENOTDIR:
        with contextlib.suppress(OSError):
            if stat.S_ISLNK(os.stat(name, dir_fd=at, follow_symlinks=False).st_mode):
                return f"{shown} is a symbolic link: links on the way are not followed"
        return f"{shown} is not a directory"
    return f"{shown}: {e.strerror}"


def _transform(prefix: str) -> list[str]:
    """tar's option that names members `prefix` + name (link targets untouched), or none."""
    if not prefix:
        return []
    escaped = re.sub(r"([\\&,])", r"\\\1", prefix)  # sed's replacement: \, & and the delimiter
    return [f"--transform=s,^,{escaped},S"]


def pack_as(
    user: pwd.struct_passwd | None, work_dir: Path, rel: str, out: Path, max_bytes: int | None = None
) -> None:
    """`tar -czf OUT REL` in `work_dir` as `user` (None: the agent's own user), the members named
    as REL; raises ValueError with the reason (a link on the way, tar's first complaint).

    REL is walked by `open_beneath`; tar starts from the directory it reached (as the user, so
    reopening it is checked against the user's rights) and gets the last name alone: no name is
    ever looked up through a link. `max_bytes` bounds the archive written (the file-size limit of
    tar and its gzip): a job that wrote 100 GiB is refused there, not packed whole first."""
    with dir_fd(work_dir) as wfd, open_beneath(wfd, rel) as at, out.open("wb") as f:
        # --hard-dereference: a file with two names travels twice, never as a hard link (refused);
        # --no-unquote: the name is taken as it is (tar would read `\1` in it as an escape)
        args = ["--create", "--gzip", "--hard-dereference", "--no-unquote", *_transform(at.prefix)]
        args += ["--file", "-", "--", at.name]
        r = run_tar(user, at.dir_fd, args, stdout=f.fileno(), max_file_bytes=max_bytes)
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
