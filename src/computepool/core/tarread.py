"""A strict reader of tar archives (ustar, GNU, pax), for archives someone else made.

Python's tarfile reads leniently (`+0` or `0_1` in a number field, a broken header taken as the
end, a member's data cut short), and GNU tar reads differently (`+0` is an obsolete base-64 number
to it, 52). What one reader skips as data the other reads as headers, so a checker built on a
lenient reader judges an archive that is not the one unpacked. This reader accepts only what both
read alike, and refuses the rest naming the member and the field:
- number fields: octal digits after optional spaces, then only spaces or NULs (POSIX and GNU
  tar's own output), or GNU base-256 (a first byte 0x80) for uid, gid, size and mtime, within the
  range GNU tar takes; `+`, `-`, tabs, a NUL ahead of the digits are refused;
- every header's checksum (the unsigned or the signed sum, as GNU tar takes either);
- the ustar (`ustar\\0` `00`) or GNU (`ustar  \\0`) magic: an old v7 header is refused;
- entries of a known kind only; data only for files; a name ending in `/` only for directories;
- GNU long names and link targets and pax headers, each at most once per member, with strict
  records and a short list of keys (sparse files, global headers and the like are refused);
- the end is the end-of-archive marker: two zero blocks. Nothing past it is read; an archive that
  ends without it, or in the middle of a header or of data, is refused.
What it reads is bounded: the declared data, the headers, and at most `MAX_META_BYTES` of
extended headers in all; `read_bytes` counts what was decompressed.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, Literal

BLOCK = 512
RECORD = 20 * BLOCK  # GNU tar's default record: the end marker is padded to it
MAX_PAX_BYTES = 8 << 10  # one pax extended header's records
MAX_LONG_BYTES = 4 << 10  # one GNU long name or link target (names over 1024 bytes are refused later)
MAX_META_BYTES = 64 << 20  # all extended headers of an archive together
MAX_PAX_RECORDS = 32  # in one pax header

Kind = Literal["file", "dir", "symlink", "hardlink", "char", "block", "fifo"]
_KINDS: dict[bytes, Kind] = {
    b"0": "file", b"\0": "file", b"7": "file", b"1": "hardlink", b"2": "symlink",
    b"3": "char", b"4": "block", b"5": "dir", b"6": "fifo",
}  # fmt: skip
_META = (b"x", b"L", b"K")
_NUMBERS = (  # field, its bytes, the largest base-256 value GNU tar takes there (0: octal only)
    ("mode", 100, 108, 0), ("uid", 108, 116, 2**32 - 1), ("gid", 116, 124, 2**32 - 1),
    ("size", 124, 136, 2**63 - 1), ("mtime", 136, 148, 2**63 - 1),
)  # fmt: skip
_MAX_SIZE = 2**63 - 1
_OCTAL = re.compile(rb" *([0-7]+)[ \0]*")
_DECIMAL = re.compile(rb"0|[1-9][0-9]*")
_TIME = re.compile(rb"(-?[0-9]+)(\.[0-9]+)?")
_RECORD_LEN = re.compile(rb"([1-9][0-9]*) ")
_PAX_IGNORED = {"atime", "ctime", "uid", "gid", "uname", "gname", "comment", "hdrcharset", "charset"}
_PAX_IGNORED_PREFIXES = ("SCHILY.xattr.", "LIBARCHIVE.xattr.", "SCHILY.acl.", "SCHILY.fflags")


class UnsafeArchive(Exception):
    """The archive holds a member that may not be unpacked (or is not a tar archive we read alike)."""


@dataclass(frozen=True)
class Member:
    """One entry as the archive declares it (extended headers applied)."""

    name: str  # UTF-8; bytes that are not kept with surrogateescape
    kind: Kind
    size: int  # bytes of data (files only; 0 for the rest)
    linkname: str
    mode: int
    mtime: int


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _shown(raw: bytes) -> str:
    return repr(raw.rstrip(b"\0").decode("latin-1"))


def _number(raw: bytes, where: str, what: str, base256_max: int = 0) -> int:
    """A header's number field, strictly: octal (leading spaces, trailing spaces/NULs), or where
    `base256_max` is given, GNU base-256 (a first byte 0x80) up to it."""
    if raw[:1] == b"\x80" and base256_max:
        value = int.from_bytes(raw[1:], "big")
        if value > base256_max:
            raise UnsafeArchive(f"{where}: {what}: {value} is out of range")
        return value
    m = _OCTAL.fullmatch(raw)
    if m is None:
        raise UnsafeArchive(f"{where}: {what}: {_shown(raw)} is not an octal number")
    return int(m.group(1), 8)


def _header_name(block: bytes) -> bytes:
    return block[:100].split(b"\0", 1)[0]


def _check_block(block: bytes, where: str) -> None:
    """The checksum (the field counted as spaces) and the magic of a header block."""
    recorded = _number(block[148:156], where, "checksum")
    unsigned = sum(block) - sum(block[148:156]) + 8 * 0x20
    if recorded != unsigned:
        high = sum(1 for b in block[:148] + block[156:] if b >= 0x80)
        if recorded != unsigned - 256 * high:
            raise UnsafeArchive(f"{where}: a wrong header checksum")
    if block[257:265] not in (b"ustar\x0000", b"ustar  \0"):
        raise UnsafeArchive(f"{where}: not a ustar or GNU tar header (magic {_shown(block[257:265])})")


def _pax(payload: bytes, where: str) -> dict[str, bytes]:
    """The records `LEN KEY=VALUE\\n` of a pax extended header, strictly."""
    out: dict[str, bytes] = {}
    pos = 0
    while pos < len(payload):
        m = _RECORD_LEN.match(payload, pos)
        end = pos + int(m.group(1)) if m else 0
        if m is None or end > len(payload) or payload[end - 1 : end] != b"\n":
            raise UnsafeArchive(f"{where}: a malformed extended header record")
        key_raw, eq, value = payload[m.end() : end - 1].partition(b"=")
        try:
            key = key_raw.decode("utf-8")
        except UnicodeDecodeError:
            key = ""
        if not eq or not key or key in out or len(out) >= MAX_PAX_RECORDS:
            raise UnsafeArchive(f"{where}: a malformed or repeated extended header record")
        if key not in ("path", "linkpath", "size", "mtime") and not (
            key in _PAX_IGNORED or key.startswith(_PAX_IGNORED_PREFIXES)
        ):
            raise UnsafeArchive(f"{where}: extended header key {key!r} is not supported")
        out[key] = value
        pos = end
    for key, pattern in (("size", _DECIMAL), ("uid", _DECIMAL), ("gid", _DECIMAL), ("mtime", _TIME),
                         ("atime", _TIME), ("ctime", _TIME)):  # fmt: skip
        if key in out and pattern.fullmatch(out[key]) is None:
            raise UnsafeArchive(f"{where}: extended header {key}={_shown(out[key])} is not a number")
    for key in ("path", "linkpath"):
        if key in out and (not out[key] or b"\0" in out[key]):
            raise UnsafeArchive(f"{where}: an empty extended header {key}, or one holding a NUL")
    return out


def _long(payload: bytes, where: str) -> bytes:
    """A GNU long name or link target: the text, then NULs only, at least one (without it GNU tar
    reads on into the padding after it, up to a NUL there)."""
    text = payload.rstrip(b"\0")
    if not text or b"\0" in text or text == payload:
        raise UnsafeArchive(f"{where}: a GNU long name empty, holding a NUL, or without its NUL")
    return text


def decompressed(f: BinaryIO) -> io.BufferedIOBase:
    """`f` read through gzip, bzip2 or xz when its first bytes say so (each stream of a
    concatenation read, as the tools read them), else as it is."""
    buf: io.BufferedReader = f if isinstance(f, io.BufferedReader) else io.BufferedReader(f)  # type: ignore[arg-type]
    head = buf.peek(6)[:6]
    if head.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=buf, mode="rb")
    if head.startswith(b"BZh"):
        return bz2.BZ2File(buf)
    if head.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(buf)
    return buf


class TarReader:
    """Members one by one (`next`), their data on demand (`data`); see the module's rules."""

    def __init__(self, f: BinaryIO, *, max_data: int | None = None) -> None:
        """`max_data`: the most file data to read; more, with the headers' share, is refused."""
        self._f = decompressed(f)
        self.read_bytes = 0  # decompressed bytes read
        self.meta_bytes = 0
        self._left = self._pad = 0  # the current member's data still unread, and its padding
        self.limit = None if max_data is None else max_data + MAX_META_BYTES
        self.members = 0

    def _read(self, n: int, *, eof_ok: bool = False) -> bytes:
        """Exactly `n` bytes (or none, at the end, where `eof_ok`); counted, and bounded."""
        try:
            out = self._f.read(n)
            while 0 < len(out) < n and (more := self._f.read(n - len(out))):
                out += more
        except (OSError, EOFError, zlib.error, lzma.LZMAError, ValueError) as e:
            raise UnsafeArchive(f"not a readable archive: {e}") from None
        if len(out) < n:
            if eof_ok and not out:
                return b""
            if self.read_bytes == 0:
                raise UnsafeArchive(f"not a readable tar archive ({len(out)} bytes)")
            raise UnsafeArchive(f"the archive ends in the middle of an entry (at byte {self.read_bytes})")
        self.read_bytes += n
        # each member: its header, three extended ones, its data's padding (and the end marker)
        bound = None if self.limit is None else self.limit + (self.members + 2) * 5 * BLOCK
        if bound is not None and self.read_bytes > bound:
            raise UnsafeArchive(f"the archive reads to more than {bound} bytes")
        return out

    def data(self, chunk: int = 1 << 20) -> Iterator[bytes]:
        """The rest of the current member's data (its padding read after it)."""
        while self._left:
            part = self._read(min(chunk, self._left))
            self._left -= len(part)
            yield part
        if self._pad:
            self._read(self._pad)
            self._pad = 0

    def next(self) -> Member | None:
        """The next member, or None at the end-of-archive marker. Raises UnsafeArchive."""
        for _ in self.data():
            pass
        ext = _Extended()
        while True:
            at = self.read_bytes
            block = self._read(BLOCK, eof_ok=True)
            if not block:
                raise UnsafeArchive(
                    "not a readable tar archive (empty)"
                    if at == 0
                    else "the archive ends without its end marker (two zero blocks)"
                )
            if not any(block):
                second = self._read(BLOCK, eof_ok=True)
                if ext.seen or len(second) != BLOCK or any(second):
                    raise UnsafeArchive(f"a lone zero block at byte {at} (the end marker is two)")
                return None
            where = repr(_text(_header_name(block))) if _header_name(block) else f"header at byte {at}"
            try:
                _check_block(block, where)
            except UnsafeArchive as e:
                raise UnsafeArchive(f"not a readable tar archive: {e}" if at == 0 else str(e)) from None
            numbers = {key: _number(block[a:b], where, key, top) for key, a, b, top in _NUMBERS}
            typeflag = block[156:157]
            if typeflag not in _META:
                return self._member(block, typeflag, numbers, ext, at)
            if typeflag in ext.seen:
                raise UnsafeArchive(f"{where}: two extended headers of type {_shown(typeflag)} for one entry")
            ext.seen.add(typeflag)
            size = numbers["size"]
            if size > (MAX_PAX_BYTES if typeflag == b"x" else MAX_LONG_BYTES):
                raise UnsafeArchive(f"{where}: an extended header of {size} bytes")
            self.meta_bytes += size
            if self.meta_bytes > MAX_META_BYTES:
                raise UnsafeArchive(f"the archive's extended headers pass {MAX_META_BYTES} bytes")
            payload = self._read(size)
            self._read(-size % BLOCK)
            if typeflag == b"x":
                ext.pax = _pax(payload, where)
            elif typeflag == b"L":
                ext.name = _long(payload, where)
            else:
                ext.link = _long(payload, where)

    def _member(
        self, block: bytes, typeflag: bytes, numbers: dict[str, int], ext: _Extended, at: int
    ) -> Member:
        """The member a header declares, its extended headers applied."""
        pax = ext.pax
        name, linkname = _header_name(block), block[157:257].split(b"\0", 1)[0]
        prefix = block[345:500].split(b"\0", 1)[0]
        if block[257:263] == b"ustar\0" and prefix:
            name = prefix + b"/" + name
        if ("path" in pax and ext.name is not None) or ("linkpath" in pax and ext.link is not None):
            raise UnsafeArchive(f"header at byte {at}: both a pax name and a GNU long one")
        name = pax.get("path") or ext.name or name
        linkname = pax.get("linkpath") or ext.link or linkname
        shown = repr(_text(name))
        kind = _KINDS.get(typeflag)
        if not name:
            raise UnsafeArchive(f"header at byte {at}: an entry without a name")
        if kind is None:
            raise UnsafeArchive(f"{shown}: entries of type {_shown(typeflag)} are not supported")
        size = int(pax["size"]) if "size" in pax else numbers["size"]
        if size > _MAX_SIZE:
            raise UnsafeArchive(f"{shown}: size: {size} is out of range")
        if size and kind != "file":
            raise UnsafeArchive(f"{shown}: a {kind} with {size} bytes of data")
        if name.endswith(b"/") and kind != "dir":
            raise UnsafeArchive(f"{shown}: a name ending in '/' for a {kind}")
        mtime = numbers["mtime"]
        if "mtime" in pax:
            mtime = int(pax["mtime"].split(b".")[0])
        self._left, self._pad = size, -size % BLOCK
        self.members += 1
        return Member(_text(name), kind, size, _text(linkname), numbers["mode"] & 0o7777, mtime)


@dataclass
class _Extended:
    """What the extended headers ahead of one member said."""

    seen: set[bytes] = field(default_factory=set)  # their types
    pax: dict[str, bytes] = field(default_factory=dict)
    name: bytes | None = None  # GNU long name
    link: bytes | None = None  # GNU long link target
