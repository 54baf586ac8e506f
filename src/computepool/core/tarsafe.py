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

One reading of the archive: it is read by core/tarread.py, strictly (what GNU tar and Python read
alike, or a refusal), and the unpacker is never handed the upload itself but `canonical`: a plain
GNU-format tar written here from what was read, holding exactly the members judged — their names
as judged, only files, directories and links, nothing past the end marker. Checking the upload and
then letting GNU tar read it again would leave two parsers to agree on every odd header (a `+0`
size was 0 bytes to one, 52 to the other; zero blocks past the end were read by one only); listing
it with `tar -t` first would still leave the listing and the extraction two readings. Re-written,
the bytes tar reads are ones this module wrote, from the members it judged, so what is unpacked is
what was checked. The re-write reads the upload a second time and judges it again as it goes; a
link not judged the first time, or another member count, stops it (the upload changed).
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Literal

from computepool.core.tarread import BLOCK, RECORD, Member, TarReader, UnsafeArchive

SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_MEMBERS = 100_000  # entries in one archive
MAX_NAME_BYTES = 1024  # a member's name, and a link's target
MAX_RESOLVED_BYTES = 4096  # a link's target once the archive's links on its way are followed
MAX_LINK_HOPS = 40  # as the kernel's ELOOP
MAX_MTIME = 8**11 - 1  # what a GNU header's octal field holds

LinksOut = Literal["refuse", "skip"]


@dataclass(frozen=True)
class Rules:
    max_bytes: int | None = None  # the files' bytes in all
    max_members: int = MAX_MEMBERS
    links_out: LinksOut = "refuse"  # or "skip": links out and special files are left out


@dataclass
class Verdict:
    """What a checked archive holds: its entries, their bytes, and what is left out when skipping."""

    members: int = 0
    bytes: int = 0
    left_out: set[str] = field(default_factory=set)  # member names (links out, special files)
    links: dict[tuple[str, ...], str] = field(default_factory=dict)  # links kept, by path
    read: int = 0  # bytes of tar read (decompressed): never past the end marker
    rules: Rules = field(default_factory=Rules)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_sha256(text: str) -> bool:
    return bool(SHA256.match(text))


def _parts(name: str) -> tuple[str, ...]:
    return tuple(p for p in PurePosixPath(name).parts if p not in ("", "."))


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogateescape"))


class Checker:
    """Judges members in archive order (`see`), then the links as a whole (`finish`). Given the
    verdict of a first reading (`expected`), it also stops at any link that reading did not keep."""

    def __init__(self, rules: Rules, expected: Verdict | None = None) -> None:
        self.rules, self.expected = rules, expected
        self.verdict = Verdict(rules=rules)
        self.links: dict[tuple[str, ...], str] = {}
        self.seen: set[tuple[str, ...]] = set()  # every name, and every directory on the way to one

    def see(self, m: Member) -> bool:
        """Raises UnsafeArchive; False for a member left out (`links_out="skip"`)."""
        name = m.name
        v, rules = self.verdict, self.rules
        v.members += 1
        if v.members > rules.max_members:
            raise UnsafeArchive(f"the archive holds more than {rules.max_members} entries")
        if _nbytes(name) > MAX_NAME_BYTES:
            raise UnsafeArchive(f"{name[:60]!r}…: a name over {MAX_NAME_BYTES} bytes")
        path = PurePosixPath(name)
        if name.startswith("/") or path.is_absolute():
            raise UnsafeArchive(f"{name!r}: absolute path in the archive")
        if ".." in path.parts:
            raise UnsafeArchive(f"{name!r}: '..' in a path of the archive")
        parts = tuple(p for p in path.parts if p not in ("", "."))
        for i in range(1, len(parts) + 1):
            if parts[:i] in self.links:
                what = "replaces" if i == len(parts) else "passes through"
                raise UnsafeArchive(f"{name!r}: {what} the archive's link {'/'.join(parts[:i])!r}")
        if m.kind == "hardlink":
            raise UnsafeArchive(f"{name!r}: hard links are refused")
        if m.kind not in ("file", "dir", "symlink"):
            if rules.links_out == "skip":
                v.left_out.add(name)
                return False
            raise UnsafeArchive(f"{name!r}: devices, fifos and other special files are refused")
        if not parts and m.kind != "dir":
            raise UnsafeArchive(f"{name!r}: a {m.kind} in place of the archive's root")
        keep = self._link(m, parts) if m.kind == "symlink" else True
        for i in range(1, len(parts) + 1):
            self.seen.add(parts[:i])
        v.bytes += m.size
        if rules.max_bytes is not None and v.bytes > rules.max_bytes:
            raise UnsafeArchive(f"the archive unpacks to more than {rules.max_bytes} bytes")
        return keep

    def _link(self, m: Member, parts: tuple[str, ...]) -> bool:
        name, target = m.name, m.linkname
        if parts in self.seen:
            raise UnsafeArchive(f"{name!r}: a link over an entry the archive already holds")
        if _nbytes(target) > MAX_NAME_BYTES:
            raise UnsafeArchive(f"{name!r}: a link target over {MAX_NAME_BYTES} bytes")
        self.links[parts] = target
        if self.expected is None:
            return True
        if self.expected.links.get(parts) == target:
            return True
        if "/".join(parts) in self.expected.left_out and self.rules.links_out == "skip":
            return False
        raise UnsafeArchive(f"{name!r}: a link the first reading did not hold (the archive changed)")

    def finish(self) -> Verdict:
        """Resolve every link against all the others: those that lead out are refused (or left out)."""
        for parts, target in self.links.items():
            why = self._leads_out(parts[:-1], target)
            if why:
                name = "/".join(parts)
                if self.rules.links_out == "skip":
                    self.verdict.left_out.add(name)
                    continue
                raise UnsafeArchive(f"{name!r}: link to {target!r} {why}")
            self.verdict.links[parts] = target
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
    rules = Rules(max_bytes, max_members, links_out)
    checker = Checker(rules)
    reader = TarReader(f, max_data=max_bytes)
    while (m := reader.next()) is not None:
        checker.see(m)
    verdict = checker.finish()
    verdict.read = reader.read_bytes
    return verdict


def _header(m: Member, parts: tuple[str, ...]) -> bytes:
    info = tarfile.TarInfo("/".join(parts) or ".")
    info.type = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE}[m.kind]
    info.size = m.size
    info.mode = 0o777 if m.kind == "symlink" else m.mode & 0o777
    info.mtime = min(max(m.mtime, 0), MAX_MTIME)
    info.linkname = m.linkname if m.kind == "symlink" else ""
    return info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")


def _rewrite(f: BinaryIO, verdict: Verdict) -> Generator[bytes, None, None]:
    checker = Checker(verdict.rules, expected=verdict)
    reader = TarReader(f, max_data=verdict.rules.max_bytes)
    written = 0
    while (m := reader.next()) is not None:
        if not checker.see(m):
            continue
        head = _header(m, _parts(m.name))
        yield head
        yield from reader.data()
        pad = bytes(-m.size % BLOCK)
        yield pad
        written += len(head) + m.size + len(pad)
    if checker.verdict.members != verdict.members:
        raise UnsafeArchive("the archive changed between its check and its unpacking")
    yield bytes(2 * BLOCK + -(written + 2 * BLOCK) % RECORD)


class _Chunks(io.RawIOBase):
    """A readable stream of what a generator yields."""

    def __init__(self, chunks: Generator[bytes, None, None]) -> None:
        self._chunks = chunks
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._buf:
            nxt = next(self._chunks, None)
            if nxt is None:
                return 0
            self._buf = memoryview(nxt)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def close(self) -> None:
        self._chunks.close()
        super().close()


def canonical(f: BinaryIO, verdict: Verdict) -> io.BufferedReader:
    """The archive `f` (read again from where it stands: its start) re-written as a plain GNU tar of
    exactly the members `verdict` judged, left-out ones left out: what the unpacker reads. Reading
    it raises UnsafeArchive where the archive is no longer the one judged."""
    return io.BufferedReader(_Chunks(_rewrite(f, verdict)), 1 << 16)


def _streamed(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The members one by one, without `tarfile` keeping every header read (it would, in a list)."""
    while (m := tar.next()) is not None:
        tar.members.clear()  # type: ignore[attr-defined]  # tarfile's list of every header read
        yield m


def extract(
    data: bytes,
    dest: Path,
    *,
    max_bytes: int | None = None,
    max_members: int = MAX_MEMBERS,
    links_out: LinksOut = "refuse",
) -> Verdict:
    """Unpack a tar.gz into `dest` (made if missing) once the whole of it has passed `check_stream`:
    what is unpacked is its `canonical` re-write, read by tarfile (with its "data" filter too).

    `dest` must be new or empty: the checks assume no link is there before the archive's own.
    With `links_out="skip"`, links that lead out and special files are left out (`left_out`)."""
    verdict = check_stream(
        io.BytesIO(data), max_bytes=max_bytes, max_members=max_members, links_out=links_out
    )
    dest.mkdir(parents=True, exist_ok=True)
    with canonical(io.BytesIO(data), verdict) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
        try:
            tar.extractall(dest, members=_streamed(tar), filter="data")
        except tarfile.FilterError as e:
            raise UnsafeArchive(str(e)) from None
        except (tarfile.TarError, EOFError, ValueError) as e:
            raise UnsafeArchive(f"broken archive: {e}") from None
    return verdict


def safe_extract(data: bytes, dest: Path, *, max_bytes: int | None = None) -> int:
    """Unpack a tar.gz into a new or empty `dest`, refusing unsafe archives; the number of entries."""
    return extract(data, dest, max_bytes=max_bytes).members
