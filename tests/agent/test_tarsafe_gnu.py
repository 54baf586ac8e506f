"""The checker's reading of an archive against GNU tar's, on archives made by tarfile and then
mutated header byte by header byte (number fields, types, names, checksums, magic, extended
headers, what follows the end marker). Where the checker accepts, GNU tar must list the same
members (kinds, names, sizes, link targets) from the upload, and exactly the accepted ones from the
re-write it is handed; tarfile (the client's unpacker) too."""

from __future__ import annotations

import codecs
import gzip
import io
import re
import subprocess
import tarfile
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st

from computepool.core.tarread import TarReader
from computepool.core.tarsafe import UnsafeArchive, Verdict, canonical, check_stream

BLOCK = 512
FIELDS = {  # name: (start, end) in a header block
    "name": (0, 100), "mode": (100, 108), "uid": (108, 116), "gid": (116, 124), "size": (124, 136),
    "mtime": (136, 148), "chksum": (148, 156), "type": (156, 157), "linkname": (157, 257),
    "magic": (257, 263), "version": (263, 265), "prefix": (345, 500),
}  # fmt: skip
NUMBER_VALUES = [
    b"+0", b"-0", b"+1", b"-1", b" 17", b"17 ", b"\x0017", b"0_1", b" \t1", b"1\t", b"8", b"\x80",
    b"\x80\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01", b"\xff\xff", b"0000001", b"00000000001",
    b"7777777", b"77777777777", b"", b"    ", b"1 2", b"1\x002",
]  # fmt: skip
TYPES = list(b"0123456789xgLKSVMDNAZ\0 ")
NAME_VALUES = [b"a/", b"a//b", b"./a", b"a/./b", b"../a", b"/etc/x", b"a\\b", b"\xff\xfe", b"a\nb", b"", b"."]
KINDS = {"-": "file", "C": "file", "d": "dir", "l": "symlink", "h": "hardlink", "p": "fifo", "c": "char",
         "b": "block"}  # fmt: skip
LINE = re.compile(rb'^(.)\S* +\S+ +(\S+) .*? "((?:[^"\\]|\\.)*)"(?:( -> | link to )"((?:[^"\\]|\\.)*)")?$')


@dataclass(frozen=True)
class Entry:
    kind: str
    name: bytes  # its path, `.` and empty parts dropped
    size: int  # files only
    link: bytes  # symbolic links only


def _norm(name: bytes) -> bytes:
    return b"/".join(p for p in name.split(b"/") if p not in (b"", b".")) or b"."


def _entry(kind: str, name: bytes, size: int, link: bytes) -> Entry:
    return Entry(kind, _norm(name), size if kind == "file" else 0, link if kind == "symlink" else b"")


def _parts(e: Entry) -> tuple[str, ...]:
    return tuple(e.name.decode("utf-8", "surrogateescape").split("/"))


def gnu_listing(tar_bytes: bytes, *, gz: bool = False) -> tuple[int, list[Entry], bytes]:
    """What GNU tar lists (its exit status, the entries, its complaints)."""
    r = subprocess.run(
        ["tar", "--list", "--verbose", "--numeric-owner", "--full-time", "--quoting-style=c", "--file", "-"]
        + (["--gzip"] if gz else []),
        input=tar_bytes,
        capture_output=True,
        env={"LANG": "C.UTF-8", "PATH": "/usr/bin:/bin"},
        check=False,
        timeout=60,
    )
    out = []
    for line in r.stdout.splitlines():
        m = LINE.match(line)
        assert m, line
        kind = KINDS[m.group(1).decode()]
        name = codecs.escape_decode(m.group(3))[0]
        link = codecs.escape_decode(m.group(5))[0] if m.group(5) is not None else b""
        out.append(_entry(kind, name, int(m.group(2)) if kind == "file" else 0, link))
    return r.returncode, out, r.stderr


def _raw(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def checker_listing(tar_bytes: bytes) -> list[Entry]:
    reader, out = TarReader(io.BytesIO(tar_bytes)), []
    while (m := reader.next()) is not None:
        out.append(_entry(m.kind, _raw(m.name), m.size, _raw(m.linkname)))
    return out


@st.composite
def names(draw: st.DrawFn) -> str:
    part = st.text(alphabet="abz._- é", min_size=1, max_size=8).filter(lambda p: p not in (".", ".."))
    parts = draw(st.lists(part, min_size=1, max_size=3))
    if draw(st.booleans()):
        parts.insert(0, draw(st.sampled_from(["d" * 60, "e" * 99, "f" * 140])))
    return "/".join(parts)


@st.composite
def archives(draw: st.DrawFn) -> tuple[bytes, list[int], int]:
    """A tarfile-made tar, where each member's first header block starts, and where its end marker
    does."""
    fmt = draw(st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
    raw = io.BytesIO()
    try:
        with tarfile.open(fileobj=raw, mode="w", format=fmt) as tar:
            for _ in range(draw(st.integers(1, 4))):
                info = tarfile.TarInfo(draw(names()))
                info.type = draw(st.sampled_from([tarfile.REGTYPE] * 3 + [tarfile.DIRTYPE, tarfile.SYMTYPE,
                                                  tarfile.FIFOTYPE]))  # fmt: skip
                info.mtime = draw(st.integers(0, 2**33))
                data = b""
                if info.type == tarfile.REGTYPE:
                    data = draw(st.binary(max_size=700))
                    info.size = len(data)
                elif info.type == tarfile.SYMTYPE:
                    info.linkname = draw(names())
                tar.addfile(info, io.BytesIO(data))
    except ValueError:  # a name ustar cannot hold
        reject()
    data = raw.getvalue()
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        starts = [m.offset for m in t.getmembers()]
        marker = t.offset
    return data, starts, marker


def fix_checksum(block: bytearray) -> None:
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)


PAX_KEYS = [b"path", b"linkpath", b"size", b"mtime", b"uid", b"comment", b"GNU.sparse.size",
            b"SCHILY.xattr.user.x", b"hdrcharset", b"x y", b""]  # fmt: skip
PAX_VALUES = [
    b"x",
    b"a/b",
    b"a/",
    b"",
    b"5",
    b"+5",
    b"05",
    b"1.5",
    b"-1",
    b"\xff",
    b"a\nb",
    b"a\0b",
    b"9" * 25,
]


@st.composite
def extended_header(draw: st.DrawFn) -> bytes:
    """A pax header or a GNU long name or link target, well made or not, for the next member."""
    kind = draw(st.sampled_from([b"x", b"L", b"K"]))
    if kind == b"x":
        payload = b""
        for _ in range(draw(st.integers(0, 3))):
            body = b" " + draw(st.sampled_from(PAX_KEYS)) + b"=" + draw(st.sampled_from(PAX_VALUES)) + b"\n"
            n = len(body) + 1
            n += len(str(n + len(str(n)) - 1)) - 1
            payload += str(n + draw(st.sampled_from([0, 0, 0, -1, 1]))).encode() + body
    else:
        payload = draw(st.sampled_from(PAX_VALUES)) + draw(st.sampled_from([b"\0", b"", b"\0\0x"]))
    info = tarfile.TarInfo("././@LongLink")
    info.type, info.size = kind, len(payload)
    fmt = draw(st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT]))
    return info.tobuf(format=fmt) + payload + bytes(-len(payload) % BLOCK)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data, starts, marker = draw(archives())
    buf = bytearray(data)
    for _ in range(draw(st.integers(0, 3))):
        what = draw(st.sampled_from(["field", "field", "field", "byte", "tail", "extended"]))
        if what == "field":
            at = draw(st.sampled_from(starts)) + BLOCK * draw(st.sampled_from([0, 0, 0, 1, 2]))
            if at + BLOCK > len(buf):
                continue
            block = bytearray(buf[at : at + BLOCK])
            name = draw(st.sampled_from(sorted(FIELDS)))
            a, b = FIELDS[name]
            if name == "type":
                value = bytes([draw(st.sampled_from(TYPES))])
            elif name in ("name", "linkname", "prefix"):
                value = draw(st.sampled_from(NAME_VALUES) | st.binary(max_size=b - a))
            elif name in ("magic", "version"):
                value = draw(st.sampled_from([b"ustar\0", b"ustar ", b" \0", b"00", b"\0\0", b"us"]))
            else:
                value = draw(st.sampled_from(NUMBER_VALUES) | st.binary(min_size=1, max_size=b - a))
            block[a:b] = value[: b - a].ljust(b - a, b"\0") if name != "chksum" else value.ljust(8, b" ")[:8]
            if name != "chksum" and draw(st.booleans() | st.just(True)):
                fix_checksum(block)
            buf[at : at + BLOCK] = block
        elif what == "extended":
            at = draw(st.sampled_from(starts))
            if at <= len(buf):
                buf[at:at] = draw(extended_header())
        elif what == "byte":
            at = draw(st.integers(0, marker - 1))
            first = at - at % BLOCK
            if first + BLOCK > len(buf):
                continue
            buf[at] = draw(st.integers(0, 255))
            if draw(st.booleans()):
                block = bytearray(buf[first : first + BLOCK])
                fix_checksum(block)
                buf[first : first + BLOCK] = block
        else:
            tail = draw(st.sampled_from(["cut", "junk", "lone", "again"]))
            if tail == "cut" and buf:
                del buf[draw(st.integers(0, len(buf) - 1)) :]
            elif tail == "junk":
                buf += draw(st.binary(min_size=1, max_size=2 * BLOCK)).ljust(BLOCK, b"\0")
            elif tail == "lone" and marker + BLOCK <= len(buf):
                buf[marker + BLOCK : marker + 2 * BLOCK] = data[starts[0] : starts[0] + BLOCK]
            else:
                del buf[marker:]
                buf += data
    return bytes(buf)


def assert_one_reading(data: bytes, *, gz: bool = False) -> Verdict | UnsafeArchive:
    """Judged by the checker: refused (the refusal), or read as GNU tar reads it, and re-written to exactly
    what was accepted — GNU tar and tarfile both reading the re-write as the checker listed it."""
    upload = gzip.compress(data) if gz else data
    try:
        verdict = check_stream(io.BytesIO(upload), links_out="skip")
    except UnsafeArchive as e:
        return e
    ours = checker_listing(upload)
    rc, theirs, complaints = gnu_listing(upload, gz=gz)
    assert rc == 0, complaints
    assert theirs == ours
    kept = [
        e for e in ours if e.kind in ("file", "dir") or e.kind == "symlink" and _parts(e) in verdict.links
    ]
    rewrite = canonical(io.BytesIO(upload), verdict).read()
    rc, listed, complaints = gnu_listing(rewrite)
    assert rc == 0 and not complaints, complaints
    assert listed == kept and len(ours) == verdict.members
    with tarfile.open(fileobj=io.BytesIO(rewrite)) as t:
        seen = [
            _entry("file" if m.isfile() else "dir" if m.isdir() else "symlink", _raw(m.name), m.size,
                   _raw(m.linkname))
            for m in t.getmembers()
        ]  # fmt: skip
    assert seen == kept
    return verdict


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(), st.booleans())
def test_the_checker_and_gnu_tar_read_a_mutated_archive_alike(data: bytes, gz: bool) -> None:
    got = assert_one_reading(data, gz=gz)
    event("accepted" if isinstance(got, Verdict) else "refused: " + re.sub(r"'.*'|\d+", "_", str(got))[:40])


@pytest.mark.parametrize(
    ("field", "value", "accepted"),
    [
        ("size", b"00000000005\0", True),
        ("size", b"        5  \0", True),
        ("size", b"5" + b"\0" * 11, True),
        ("size", b"\x80" + bytes(10) + b"\x05", True),
        ("size", b"+5", False),
        ("size", b"-0", False),
        ("size", b"\x005", False),
        ("size", b"0_5", False),
        ("size", b"\t5", False),
        ("size", b"5x", False),
        ("size", b"\xff" * 12, False),
        ("mode", b"\x80" + bytes(7), False),
        ("uid", b"\x80" + b"\xff" * 7, False),
        ("mtime", b"", False),
    ],
)
def test_number_fields_are_read_strictly(field: str, value: bytes, accepted: bool) -> None:
    info = tarfile.TarInfo("f")
    info.size = 5
    block = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    a, b = FIELDS[field]
    block[a:b] = value.ljust(b - a, b"\0")
    fix_checksum(block)
    data = bytes(block) + b"hello".ljust(BLOCK, b"\0") + bytes(2 * BLOCK)
    if accepted:
        verdict = assert_one_reading(data)
        assert isinstance(verdict, Verdict) and verdict.bytes == 5
    else:
        with pytest.raises(UnsafeArchive, match=f"'f': {field}: "):
            check_stream(io.BytesIO(data))
