"""Content addresses and the one safe way to unpack an archive, shared by the client and the agent.

An archive comes from someone else (a user's upload on the agent, a job's files on a laptop), so
unpacking refuses anything that could write outside the destination: absolute names, `..`, links
that point out of the tree, devices and fifos. Python's `tarfile` "data" filter does that check;
the walk here adds a size cap and names the offending member in the error.
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
from pathlib import Path

SHA256 = re.compile(r"^[0-9a-f]{64}$")


class UnsafeArchive(Exception):
    """The archive holds a member that may not be unpacked (or is not a tar.gz at all)."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_sha256(text: str) -> bool:
    return bool(SHA256.match(text))


def check_members(tar: tarfile.TarFile, max_bytes: int | None = None) -> list[tarfile.TarInfo]:
    """Every member, after refusing the unsafe ones and a total size over `max_bytes`."""
    members = tar.getmembers()
    total = 0
    for m in members:
        name = m.name
        if name.startswith("/") or Path(name).is_absolute():
            raise UnsafeArchive(f"{name!r}: absolute path in the archive")
        if ".." in Path(name).parts:
            raise UnsafeArchive(f"{name!r}: '..' in a path of the archive")
        if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
            raise UnsafeArchive(f"{name!r}: devices, fifos and other special files are refused")
        if m.issym() or m.islnk():
            target = Path(m.linkname)
            base = Path(name).parent if m.issym() else Path()
            if target.is_absolute() or _escapes(base / target):
                raise UnsafeArchive(f"{name!r}: link to {m.linkname!r} points outside the archive")
        total += max(m.size, 0)
        if max_bytes is not None and total > max_bytes:
            raise UnsafeArchive(f"the archive unpacks to more than {max_bytes} bytes")
    return members


def _escapes(path: Path) -> bool:
    depth = 0
    for part in path.parts:
        if part == "..":
            depth -= 1
        elif part not in ("", "."):
            depth += 1
        if depth < 0:
            return True
    return False


def safe_extract(data: bytes, dest: Path, *, max_bytes: int | None = None) -> list[str]:
    """Unpack a tar.gz into `dest` (made if missing); the names unpacked. Raises UnsafeArchive."""
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:*")  # noqa: SIM115 - closed by `with` below
    except (tarfile.TarError, OSError, EOFError) as e:
        raise UnsafeArchive(f"not a readable tar archive: {e}") from None
    with tar:
        try:
            members = check_members(tar, max_bytes)
            dest.mkdir(parents=True, exist_ok=True)
            tar.extractall(dest, members=members, filter="data")
        except tarfile.FilterError as e:
            raise UnsafeArchive(str(e)) from None
        except (tarfile.TarError, EOFError, ValueError) as e:
            raise UnsafeArchive(f"broken archive: {e}") from None
    return [m.name for m in members]
