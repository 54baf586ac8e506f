"""Code archives that read one way to the checker and another way to GNU tar, which unpacks them.

A tenant uploaded an archive whose size field read `+0`: zero bytes to the checker (Python's
tarfile), 52 to GNU tar (an obsolete base-64 number), so the checker passed three members while tar
wrote a hard link, a fifo, an absolute link and 300,002 files. Another uploaded a tiny archive
followed by 256 MiB of zeros (260 KB gzipped), which the checker read block by block past the end
marker, three at a time holding every preparing thread of the node. Both go through the agent's
real path here (the blob cache's checker, then GNU tar).
"""

from __future__ import annotations

import gzip
import io
import subprocess
import tarfile
import zlib
from pathlib import Path
from typing import BinaryIO

import pytest

from computepool.agent.blobs import BlobCache, CodeUnavailable
from computepool.core.tarsafe import check_stream, sha256_hex

BLOCK = 512


def header(name: str, kind: bytes, *, size: bytes | None = None, n: int = 0, link: str = "") -> bytes:
    """A GNU tar header block; `size` replaces the size field's bytes, checksum computed after."""
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname, info.mode = kind, n, link, 0o644
    block = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    assert len(block) == BLOCK
    if size is not None:
        block[124:136] = size.ljust(12, b"\0")
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def plus_zero_archive() -> bytes:
    """`+0`: 0 bytes of data to a lenient reader, 52 (one block) to GNU tar. The block after it is a
    cover file's header to the first, skipped data to tar; what the cover file holds is headers to tar."""
    evil = [
        header("hl", tarfile.LNKTYPE, link="main.py"),
        header("p", tarfile.FIFOTYPE),
        header("abs", tarfile.SYMTYPE, link="/etc"),
        *(header(f"f{i}", tarfile.REGTYPE) for i in range(5)),
    ]
    cover = header("cover.bin", tarfile.REGTYPE, n=BLOCK * len(evil))
    body = header("main.py", tarfile.REGTYPE, size=b"+0") + cover + b"".join(evil)
    return gzip.compress(body + bytes(2 * BLOCK))


def zero_padded_archive() -> tuple[bytes, int]:
    """One small file, the end marker, then 256 MiB of zeros; gzipped (~260 KB). And the tar's size."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("main.py")
        info.size = 9
        tar.addfile(info, io.BytesIO(b"print(1)\n"))
    comp = zlib.compressobj(6, zlib.DEFLATED, 31)  # 31: a gzip wrapper
    out = [comp.compress(raw.getvalue())]
    zeros = bytes(1 << 20)
    out += [comp.compress(zeros) for _ in range(256)]
    out.append(comp.flush())
    return b"".join(out), len(raw.getvalue())


class ReadPastBound(Exception):
    """The checker read further than the archive's own bytes."""


class Counted(io.RawIOBase):
    """A stream that counts what is read from it and stops a reader going past `bound`."""

    def __init__(self, inner: BinaryIO, bound: int) -> None:
        self.inner, self.bound, self.count = inner, bound, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.inner.read(len(b))
        self.count += len(data)
        if self.count > self.bound:
            raise ReadPastBound(f"read {self.count} bytes, more than {self.bound}")
        b[: len(data)] = data
        return len(data)


def unpack(tmp_path: Path, data: bytes) -> tuple[Path, int]:
    """The agent's path for a code blob: cached by hash, checked, unpacked by GNU tar."""
    cache = BlobCache(tmp_path / "agent", None)  # type: ignore[arg-type]  # never fetches: cached
    cache.dir.mkdir(parents=True, mode=0o700)
    sha = sha256_hex(data)
    cache.path(sha).write_bytes(data)
    work = tmp_path / "work"
    work.mkdir()
    return work, cache.unpack_code(sha, work)


def tar_names(data: bytes) -> list[str]:
    r = subprocess.run(["tar", "-tzf", "-"], input=data, capture_output=True, check=False)
    return r.stdout.decode().splitlines()


def test_a_plus_zero_size_is_refused_before_tar_reads_the_headers_it_hides(tmp_path: Path) -> None:
    data = plus_zero_archive()
    hidden = tar_names(data)
    assert {"hl", "p", "abs", "f4"} <= set(hidden), hidden  # what GNU tar makes of it
    with pytest.raises(CodeUnavailable, match=r"refused the archive: 'main.py': size: .*'\+0'"):
        unpack(tmp_path, data)
    assert list((tmp_path / "work").iterdir()) == []


def test_zeros_after_the_end_marker_are_never_read(tmp_path: Path) -> None:
    data, tar_size = zero_padded_archive()
    assert len(data) < 400_000
    # the checker reads the archive up to its end marker, not a block of the padding after it
    with gzip.open(io.BytesIO(data)) as plain:
        counted = Counted(plain, bound=1 << 20)  # type: ignore[arg-type]
        assert check_stream(io.BufferedReader(counted, 4096)).members == 1
    assert counted.count <= tar_size
    # and the agent unpacks exactly what the checker listed
    work, members = unpack(tmp_path, data)
    assert members == 1
    assert [p.name for p in work.iterdir()] == ["main.py"]
    assert (work / "main.py").read_text() == "print(1)\n"
