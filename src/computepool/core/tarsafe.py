"""Content addresses and the one safe way to read an archive, shared by the client and the agent.

An archive comes from someone else (a user's upload on the agent, a job's files on a laptop), so
it is judged member by member, as a stream (a gzip bomb of headers costs one header at a time),
before anything is written. Refused: absolute names, `..`, names or link targets over 1024 bytes,
hard links, devices, fifos and sparse files, any member whose path passes through (or replaces) a
symbolic link of the archive, a link made over an entry already seen, and a symbolic link whose
target — absolute, or resolved against every link of the archive — leads out of it. Together
these mean no member is ever written through a link, whatever the unpacker's own checks (Python's
"data" filter had bypasses with long paths and link chains). Over a member count or a byte total
the archive is refused too.
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Literal

SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_MEMBERS = 100_000  # entries in one archive
MAX_NAME_BYTES = 1024  # a member's name, and a link's target
MAX_RESOLVED_BYTES = 4096  # a link's target once the archive's links on its way are followed
MAX_LINK_HOPS = 40  # as the kernel's ELOOP

LinksOut = Literal["refuse", "skip"]


class UnsafeArchive(Exception):
    """The archive holds a member that may not be unpacked (or is not a tar.gz at all)."""


@dataclass
class Verdict:
    """What a checked archive holds: its entries, their bytes, and what is left out when skipping."""

    members: int = 0
    bytes: int = 0
    left_out: set[str] = field(default_factory=set)  # member names (links out, special files)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_sha256(text: str) -> bool:
    return bool(SHA256.match(text))


def _parts(name: str) -> tuple[str, ...]:
    return tuple(p for p in PurePosixPath(name).parts if p not in ("", "."))


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogateescape"))


def open_stream(f: BinaryIO) -> tarfile.TarFile:
    """A tar stream (gzip or plain) read front to back; raises UnsafeArchive if it is not one.

    `ignore_zeros`: a broken header does not end the reading here, as it would by default, because
    GNU tar (which unpacks on the agent) skips it and goes on: every member it would write is judged.
    """
    try:
        return tarfile.open(fileobj=f, mode="r|*", ignore_zeros=True)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise UnsafeArchive(f"not a readable tar archive: {e}") from None


def stream_members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The members one by one, without `tarfile` keeping every header read (it would, in a list)."""
    while True:
        try:
            m = tar.next()
        except (tarfile.TarError, OSError, EOFError, ValueError) as e:
            raise UnsafeArchive(f"broken archive: {e}") from None
        tar.members.clear()  # type: ignore[attr-defined]  # tarfile's list of every header read
        if m is None:
            return
        yield m


class Checker:
    """Judges members in archive order (`see`), then the links as a whole (`finish`)."""

    def __init__(self, *, max_bytes: int | None, max_members: int, links_out: LinksOut) -> None:
        self.max_bytes, self.max_members, self.links_out = max_bytes, max_members, links_out
        self.verdict = Verdict()
        self.links: dict[tuple[str, ...], str] = {}
        self.seen: set[tuple[str, ...]] = set()  # every name, and every directory on the way to one

    def see(self, m: tarfile.TarInfo) -> None:
        name = m.name
        v = self.verdict
        v.members += 1
        if v.members > self.max_members:
            raise UnsafeArchive(f"the archive holds more than {self.max_members} entries")
        if _nbytes(name) > MAX_NAME_BYTES:
            raise UnsafeArchive(f"{name[:60]!r}…: a name over {MAX_NAME_BYTES} bytes")
        if name.startswith("/") or PurePosixPath(name).is_absolute():
            raise UnsafeArchive(f"{name!r}: absolute path in the archive")
        if ".." in PurePosixPath(name).parts:
            raise UnsafeArchive(f"{name!r}: '..' in a path of the archive")
        parts = _parts(name)
        for i in range(1, len(parts) + 1):
            if parts[:i] in self.links:
                what = "replaces" if i == len(parts) else "passes through"
                raise UnsafeArchive(f"{name!r}: {what} the archive's link {'/'.join(parts[:i])!r}")
        if m.islnk():
            raise UnsafeArchive(f"{name!r}: hard links are refused")
        if m.issparse() or not (m.isfile() or m.isdir() or m.issym()):
            if self.links_out == "skip":
                v.left_out.add(name)
                return
            raise UnsafeArchive(f"{name!r}: devices, fifos and other special files are refused")
        if m.issym():
            self._link(m, parts)
        for i in range(1, len(parts) + 1):
            self.seen.add(parts[:i])
        v.bytes += max(m.size, 0) if m.isfile() else 0
        if self.max_bytes is not None and v.bytes > self.max_bytes:
            raise UnsafeArchive(f"the archive unpacks to more than {self.max_bytes} bytes")

    def _link(self, m: tarfile.TarInfo, parts: tuple[str, ...]) -> None:
        name, target = m.name, m.linkname
        if not parts:
            raise UnsafeArchive(f"{name!r}: a link in place of the archive's root")
        if parts in self.seen:
            raise UnsafeArchive(f"{name!r}: a link over an entry the archive already holds")
        if _nbytes(target) > MAX_NAME_BYTES:
            raise UnsafeArchive(f"{name!r}: a link target over {MAX_NAME_BYTES} bytes")
        self.links[parts] = target

    def finish(self) -> Verdict:
        """Resolve every link against all the others: those that lead out are refused (or left out)."""
        for parts, target in self.links.items():
            why = self._leads_out(parts[:-1], target)
            if why:
                name = "/".join(parts)
                if self.links_out == "skip":
                    self.verdict.left_out.add(name)
                    continue
                raise UnsafeArchive(f"{name!r}: link to {target!r} {why}")
        return self.verdict

    def _leads_out(self, here: tuple[str, ...], target: str) -> str:
        """Why the link at `here/…` to `target` leaves the archive ('' when it stays inside)."""
        if target.startswith("/"):
            return "points outside the archive (absolute)"
        path = list(here)
        pending = list(PurePosixPath(target).parts)
        hops = 0
        while pending:
            part = pending.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                if not path:
                    return "points outside the archive"
                path.pop()
                continue
            path.append(part)
            if sum(len(p) + 1 for p in path) > MAX_RESOLVED_BYTES:
                return f"resolves to a path over {MAX_RESOLVED_BYTES} bytes"
            link = self.links.get(tuple(path))
            if link is not None:
                hops += 1
                if hops > MAX_LINK_HOPS or link.startswith("/"):
                    return "points outside the archive (through its other links)"
                path.pop()
                pending = list(PurePosixPath(link).parts) + pending
        return ""


def check_stream(
    f: BinaryIO,
    *,
    max_bytes: int | None = None,
    max_members: int = MAX_MEMBERS,
    links_out: LinksOut = "refuse",
) -> Verdict:
    """Read a whole tar(.gz) stream and judge it; raises UnsafeArchive naming the first bad member."""
    checker = Checker(max_bytes=max_bytes, max_members=max_members, links_out=links_out)
    with open_stream(f) as tar:
        for m in stream_members(tar):
            checker.see(m)
    return checker.finish()


def extract(
    data: bytes,
    dest: Path,
    *,
    max_bytes: int | None = None,
    max_members: int = MAX_MEMBERS,
    links_out: LinksOut = "refuse",
) -> Verdict:
    """Unpack a tar.gz into `dest` (made if missing) once the whole of it has passed `check_stream`.

    `dest` must be new or empty: the checks assume no link is there before the archive's own.
    With `links_out="skip"`, links that lead out and special files are left out (`left_out`)."""
    verdict = check_stream(
        io.BytesIO(data), max_bytes=max_bytes, max_members=max_members, links_out=links_out
    )
    dest.mkdir(parents=True, exist_ok=True)
    with open_stream(io.BytesIO(data)) as tar:
        wanted = (m for m in stream_members(tar) if m.name not in verdict.left_out)
        try:
            tar.extractall(dest, members=wanted, filter="data")
        except tarfile.FilterError as e:
            raise UnsafeArchive(str(e)) from None
        except (tarfile.TarError, EOFError, ValueError) as e:
            raise UnsafeArchive(f"broken archive: {e}") from None
    return verdict


def safe_extract(data: bytes, dest: Path, *, max_bytes: int | None = None) -> int:
    """Unpack a tar.gz into a new or empty `dest`, refusing unsafe archives; the number of entries."""
    return extract(data, dest, max_bytes=max_bytes).members
