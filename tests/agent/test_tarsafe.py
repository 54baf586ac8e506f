"""The archive checker (core/tarsafe.py) against real attack archives: link chains, names longer
than PATH_MAX, hard links, links over entries, archive bombs — each must be refused before a byte
is written, whoever unpacks it (the agent's tar, or the client's tarfile)."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from computepool.core.tarsafe import MAX_MEMBERS, UnsafeArchive, canonical, check_stream, extract

Add = Callable[..., None]


def archive(build: Callable[[Add], None], *, fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """A tar.gz whose members `build` adds with add(name, kind='file'|'dir'|'sym'|'hard'|'fifo', …)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz", format=fmt) as tar:

        def add(name: str, kind: str = "file", data: bytes = b"x", link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type = {
                "file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE,
                "hard": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE,
            }[kind]  # fmt: skip
            info.mode = 0o755 if kind == "dir" else 0o644
            info.linkname = link
            if kind == "file":
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)

        build(add)
    return raw.getvalue()


def path_max_escape(target_dir: str) -> bytes:
    """The published tarfile "data" filter bypass (CVE-2025-4517 class): nested dirs and links whose
    resolved path passes PATH_MAX, a link through them climbing out, a file written through it."""

    def build(add: Add) -> None:
        comp, path = "d" * 247, ""
        steps = "abcdefghijklmnop"
        for step in steps:
            add(os.path.join(path, comp), "dir")
            add(os.path.join(path, step), "sym", link=comp)
            path = os.path.join(path, comp)
        linkpath = os.path.join(*steps, "l" * 254)
        add(linkpath, "sym", link=os.path.join(*[".."] * len(steps)))
        add("escape", "sym", link=linkpath + "/.." * 17 + target_dir)
        add("escape/pwned", data=b"written through the archive\n")

    return archive(build)


def chain_escape(add: Add) -> None:
    """Each link stays inside by its own text; followed one after the other they climb out."""
    add("sub", "dir")
    add("sub/up", "sym", link="..")  # sub/up -> the root: inside
    add("x", "sym", link="sub/up/sub/up/..")  # lexically inside, really the root's parent


@pytest.mark.parametrize(
    ("build", "why"),
    [
        (lambda add: (add("a", "sym", link="."), add("a/f")), "passes through the archive's link 'a'"),
        (lambda add: (add("l", "sym", link="d"), add("l")), "replaces the archive's link 'l'"),
        (lambda add: (add("f"), add("f", "sym", link="g")), "a link over an entry"),
        (lambda add: (add("d/f"), add("d", "sym", link="e")), "a link over an entry"),
        (lambda add: add("h", "hard", link="etc/shadow"), "hard links are refused"),
        (lambda add: add("f", "fifo"), "special files"),
        (lambda add: add("l", "sym", link="/etc"), "absolute"),
        (lambda add: add("s/l", "sym", link="../../x"), "points outside the archive"),
        (chain_escape, "through its other links|points outside the archive"),
        (lambda add: add("n" * 1100), "a name over 1024 bytes"),
        (lambda add: add("l", "sym", link="a/" * 520), "a link target over 1024 bytes"),
        (lambda add: add("../x"), "'..'"),
        (lambda add: add("/abs"), "absolute path"),
    ],
)
def test_unsafe_members_are_refused_by_name(tmp_path: Path, build: Callable[[Add], None], why: str) -> None:
    data = archive(build)
    with pytest.raises(UnsafeArchive, match=why):
        check_stream(io.BytesIO(data))
    dest = tmp_path / "d"
    with pytest.raises(UnsafeArchive, match=why):
        extract(data, dest)
    assert not dest.exists()  # judged whole before anything is written


def test_the_published_path_max_bypass_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.mkdir()
    data = path_max_escape(str(target))
    with pytest.raises(UnsafeArchive):
        extract(data, tmp_path / "d")
    assert list(target.iterdir()) == []


def test_links_inside_are_kept_and_links_out_can_be_left_out(tmp_path: Path) -> None:
    def build(add: Add) -> None:
        add("a/b", "dir")
        add("a/b/f", data=b"hi")
        add("a/up", "sym", link="../a/b/f")  # climbs, but stays inside
        add("top", "sym", link="a/b")
        add("via", "sym", link="top/f")  # through another link, still inside
        add("out", "sym", link="../../etc/passwd")
        add("abs", "sym", link="/etc/passwd")
        add("p", "fifo")

    data = archive(build)
    with pytest.raises(UnsafeArchive, match="'p': devices"):
        extract(data, tmp_path / "strict")
    dest = tmp_path / "lenient"
    got = extract(data, dest, links_out="skip")
    assert got.left_out == {"out", "abs", "p"}
    assert (dest / "via").read_text() == "hi" and (dest / "a" / "up").read_text() == "hi"
    assert not (dest / "out").is_symlink() and not (dest / "abs").is_symlink() and not (dest / "p").exists()


def test_member_and_byte_caps(tmp_path: Path) -> None:
    def thirty(add: Add) -> None:
        for i in range(30):
            add(f"f{i}")

    data = archive(thirty)
    assert check_stream(io.BytesIO(data), max_members=30).members == 30
    with pytest.raises(UnsafeArchive, match="more than 29 entries"):
        check_stream(io.BytesIO(data), max_members=29)
    with pytest.raises(UnsafeArchive, match="more than 29 bytes"):
        check_stream(io.BytesIO(data), max_bytes=29)


def test_a_header_bomb_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """300,000 empty members: ~1.8 MB gzipped. Refused at the member cap, read as a stream (not a list
    of every header), in a fresh process so its peak memory (VmHWM) is the check's own."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(3 * MAX_MEMBERS):
            tar.addfile(tarfile.TarInfo(f"d/{i:09d}"))
    bomb = tmp_path / "bomb.tgz"
    bomb.write_bytes(gzip.compress(raw.getvalue(), 9))
    del raw
    code = (
        "import sys\n"
        "from computepool.core.tarsafe import check_stream, UnsafeArchive\n"
        "try:\n    check_stream(open(sys.argv[1], 'rb'), max_bytes=8 << 30)\nexcept UnsafeArchive as e:\n"
        "    print(e)\n"
        "hwm = next(line for line in open('/proc/self/status') if line.startswith('VmHWM:'))\n"
        "print(int(hwm.split()[1]) // 1024)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(bomb)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    why, rss_mib = r.stdout.strip().splitlines()
    assert why == f"the archive holds more than {MAX_MEMBERS} entries"
    assert int(rss_mib) < 120, f"peak RSS {rss_mib} MiB"  # was ~300 MiB when every header was kept


def test_our_own_packer_output_passes(tmp_path: Path) -> None:
    from computepool.client.archive import pack  # noqa: PLC0415 - the client's side

    root = tmp_path / "p"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_text("f")
    os.symlink(str(root / "a" / "b"), root / "abs_inside")  # absolute, inside: shipped as relative
    os.symlink("../a/b/f", root / "a" / "rel_up")
    os.symlink("/etc/passwd", root / "leaves")
    data = pack(root)
    dest = tmp_path / "out"
    extract(data, dest)  # strict: the agent's rules
    assert os.readlink(dest / "abs_inside") == "a/b" and (dest / "abs_inside" / "f").read_text() == "f"
    assert (dest / "a" / "rel_up").read_text() == "f" and not (dest / "leaves").is_symlink()
    assert check_stream(io.BytesIO(data)).members == 5


def _raw_member(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> bytes:
    ti = tarfile.TarInfo(name)
    ti.type, ti.size, ti.linkname = kind, len(data), link
    return ti.tobuf(format=tarfile.GNU_FORMAT) + data + b"\0" * (-len(data) % 512)


def test_a_broken_header_is_refused_where_gnu_tar_would_skip_it_and_go_on(tmp_path: Path) -> None:
    """Python's tarfile used to stop at a broken header, unlike GNU tar, which skips it and goes on
    writing: the check passed an archive whose rest was never looked at (a link to /etc, 20 MB)."""
    bad = bytearray(_raw_member("junk"))
    bad[148:156] = b"0000000\0"  # a wrong checksum
    body = _raw_member("ok.txt", b"hello\n") + bytes(bad)
    body += b"".join(_raw_member(f"f{i}.bin", bytes(1 << 20)) for i in range(4))
    body += _raw_member("out", kind=tarfile.SYMTYPE, link="/etc") + b"\0" * 1024
    data = gzip.compress(body)
    with pytest.raises(UnsafeArchive, match="'junk': a wrong header checksum"):
        check_stream(io.BytesIO(data))
    # GNU tar does go on past the broken header: what made it worth refusing
    listing = subprocess.run(["tar", "-tzf", "-"], input=data, capture_output=True, check=False).stdout
    assert b"out\n" in listing


def _plain(*members: bytes, end: bytes = b"\0" * 1024) -> bytes:
    return b"".join(members) + end


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (_plain(_raw_member("a", b"x"), end=b""), "ends without its end marker"),
        (_plain(_raw_member("a", b"x"), end=b"\0" * 512), "a lone zero block at byte 1024"),
        (_plain(_raw_member("a", b"x"), end=b"\0" * 512 + _raw_member("b")), "a lone zero block"),
        (_plain(_raw_member("a", b"x" * 600))[:1100], "ends in the middle of an entry"),
        (b"", "not a readable tar archive"),
    ],
)
def test_the_end_is_two_zero_blocks(body: bytes, why: str) -> None:
    with pytest.raises(UnsafeArchive, match=why):
        check_stream(io.BytesIO(gzip.compress(body)))


def test_nothing_past_the_end_marker_is_read() -> None:
    first = _plain(_raw_member("a", b"x"))
    data = first + _plain(_raw_member("b", kind=tarfile.SYMTYPE, link="/etc")) + bytes(1 << 20)
    verdict = check_stream(io.BytesIO(gzip.compress(data)))
    assert verdict.members == 1 and verdict.read == len(first)
    # and the re-write handed to the unpacker ends there too: GNU tar lists one member
    tar = canonical(io.BytesIO(data), verdict).read()
    listing = subprocess.run(["tar", "-tf", "-"], input=tar, capture_output=True, check=True).stdout
    assert listing == b"a\n"


def test_the_rewrite_stops_where_the_archive_is_not_the_one_checked() -> None:
    """The re-write reads the archive again: a link the first reading did not see stops it."""
    checked = _plain(_raw_member("a", b"x"), _raw_member("l", kind=tarfile.SYMTYPE, link="a"))
    changed = _plain(_raw_member("a", b"x"), _raw_member("l", kind=tarfile.SYMTYPE, link="/etc"))
    verdict = check_stream(io.BytesIO(checked))
    with pytest.raises(UnsafeArchive, match="'l': a link the first reading did not hold"):
        canonical(io.BytesIO(changed), verdict).read()
    more = _plain(_raw_member("a", b"x"), _raw_member("l", kind=tarfile.SYMTYPE, link="a"), _raw_member("b"))
    with pytest.raises(UnsafeArchive, match="changed between its check and its unpacking"):
        canonical(io.BytesIO(more), verdict).read()
