"""A directory as a deterministic tar.gz: the code a run or a function ships to the pool.

Deterministic (names sorted, mtime 0, owner 0:0, gzip header without a time) so the same files
always give the same bytes, hence the same sha256: an unchanged directory is recognised by the
server (`HEAD /blobs/{sha}`) and never sent twice. `.gitignore` files (at any depth) and a root
`.cpoolignore` (and the repository's `.git/info/exclude`) are honoured with git's own matching
rules (pathspec); `.git` is always left out, and so are links that lead out of the tree (counted,
so the CLI can say so). A link to an absolute path inside the tree is shipped as the relative
link to the same place, since the agent refuses absolute link targets.

Files that usually hold credentials (SECRET_PATTERNS, and the paths the caller names: the
`--env-file` it read) are left out too, and named, so that a secret meant for the environment is
not also readable in the job's directory; a `!name` line in an ignore file ships one after all.
"""

from __future__ import annotations

import gzip
import heapq
import io
import os
import stat
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pathspec

from computepool.core.tarsafe import UnsafeArchive, extract, safe_extract, sha256_hex

__all__ = [
    "FETCHED_FILE", "SECRET_PATTERNS", "ArchiveStats", "UnsafeArchive", "extract", "inside", "pack",
    "pack_with_stats", "remember_fetched", "safe_extract", "scan", "sha256_hex",
]  # fmt: skip

IGNORE_FILES = (".git/info/exclude", ".gitignore", ".cpoolignore")  # at the root; deeper: .gitignore
# What `cpool run --output` brought back into the directory, one path per line: never shipped again
# (it came from the pool), unless an ignore file's `!` pattern says otherwise.
FETCHED_FILE = ".cpool-fetched"
ALWAYS_SKIPPED = frozenset({".git", FETCHED_FILE})
TREE_SKIPPED = frozenset({"__pycache__"})
# credentials by their usual names (any depth), below every ignore file: a `!` pattern re-includes
SECRET_PATTERNS = (
    ".env*", "*.pem", "*.key", "*.p12", "*.pfx", ".netrc", ".pgpass",
    "id_rsa", "id_dsa", "id_ecdsa", "id_ed25519", "id_ecdsa_sk", "id_ed25519_sk",
)  # fmt: skip
_GLOB_SPECIALS = frozenset("\\*?[]")
LARGEST_SHOWN = 3  # files named when a directory is big


@dataclass(frozen=True)
class ArchiveStats:
    files: int
    bytes_in: int  # the files' sizes, before compression
    links_left_out: int = 0  # links leading out of the tree (or nowhere): not shipped
    secrets_left_out: tuple[str, ...] = ()  # paths left out as likely credentials
    largest: tuple[tuple[str, int], ...] = ()  # (path, bytes) of the biggest files, biggest first (scan)


@dataclass(frozen=True)
class _Rules:
    base: PurePosixPath  # the directory (relative to the root) whose ignore files these are
    spec: pathspec.GitIgnoreSpec


def _read_rules(directory: Path, base: PurePosixPath, names: tuple[str, ...]) -> list[_Rules]:
    out: list[_Rules] = []
    for name in names:
        path = directory / name
        if path.is_file():
            lines = path.read_text(errors="replace").splitlines()
            out.append(_Rules(base, pathspec.GitIgnoreSpec.from_lines(lines)))
    return out


def _literal(rel: PurePosixPath) -> str:
    """A gitignore line matching exactly `rel` (from the root), whatever characters it holds."""
    text = "".join("\\" + c if c in _GLOB_SPECIALS else c for c in str(rel))
    return "/" + (text[:-1] + "\\ " if text.endswith(" ") else text)


def _secret_rules(leave_out: tuple[PurePosixPath, ...]) -> list[_Rules]:
    lines = [*SECRET_PATTERNS, *(_literal(p) for p in leave_out)]
    return [_Rules(PurePosixPath("."), pathspec.GitIgnoreSpec.from_lines(lines))]


def _fetched_rules(root: Path) -> list[_Rules]:
    """The paths `--output` brought back (FETCHED_FILE), as rules below every ignore file's."""
    try:
        names = [n.strip().strip("/") for n in (root / FETCHED_FILE).read_text().splitlines()]
    except OSError:
        return []
    lines = [_literal(PurePosixPath(n)) for n in names if n and ".." not in PurePosixPath(n).parts]
    return [_Rules(PurePosixPath("."), pathspec.GitIgnoreSpec.from_lines(lines))] if lines else []


def remember_fetched(root: Path, path: str) -> None:
    """Note that `path` (relative to `root`) came back from the pool: the next pack leaves it out."""
    file = root / FETCHED_FILE
    try:
        known = set(file.read_text().splitlines())
    except OSError:
        known = set()
    name = str(PurePosixPath(path)).strip("/")
    if name and name not in known:
        with file.open("a") as f:
            f.write(name + "\n")


def _ignored(rel: PurePosixPath, is_dir: bool, rules: list[_Rules]) -> bool | None:
    """Git's precedence: the deepest rule that matches decides (a `!` pattern re-includes); None
    when no rule matches."""
    verdict: bool | None = None
    for r in rules:
        try:
            sub = rel.relative_to(r.base) if r.base != PurePosixPath(".") else rel
        except ValueError:
            continue
        text = str(sub) + ("/" if is_dir else "")
        result = r.spec.check_file(text)
        if result.include is not None:
            verdict = bool(result.include)
    return verdict


def _walk(
    root: Path, leave_out: tuple[PurePosixPath, ...] = (), secrets: list[str] | None = None
) -> Iterator[tuple[PurePosixPath, Path]]:
    """(archive name, path) of every file, dir and link of `root` not ignored, sorted. What no
    ignore file decides and the secret rules match is left out and named in `secrets`."""
    secret_rules = _secret_rules(leave_out)

    def visit(
        directory: Path, rel: PurePosixPath, rules: list[_Rules]
    ) -> Iterator[tuple[PurePosixPath, Path]]:
        top = rel == PurePosixPath(".")
        here = (_fetched_rules(directory) if top else []) + rules
        here += _read_rules(directory, rel, IGNORE_FILES if top else (".gitignore",))
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            if entry.name in ALWAYS_SKIPPED:
                continue
            name = PurePosixPath(entry.name) if rel == PurePosixPath(".") else rel / entry.name
            path = Path(entry.path)
            is_link = entry.is_symlink()
            is_dir = entry.is_dir(follow_symlinks=False)
            verdict = _ignored(name, is_dir, here)
            if verdict is None and _ignored(name, is_dir, secret_rules):
                if secrets is not None:
                    secrets.append(str(name))
                continue
            if verdict:
                continue
            if is_link:
                yield name, path  # judged by _link_text: shipped only when it stays in the tree
            elif is_dir:
                yield name, path
                yield from visit(path, name, here)
            elif entry.is_file(follow_symlinks=False):
                yield name, path

    yield from visit(root, PurePosixPath("."), [])


def _info(name: str, st: os.stat_result, kind: bytes, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    executable = bool(st.st_mode & stat.S_IXUSR)
    info.mode = 0o755 if kind == tarfile.DIRTYPE or executable else 0o644
    if kind == tarfile.SYMTYPE:
        info.mode = 0o777
        info.linkname = link
    return info


def _link_text(path: Path, name: PurePosixPath, real_root: Path) -> str | None:
    """What the link at `name` (in the tree at `real_root`) is shipped as; None when it leads out of
    the tree or nowhere. Absolute (or climbing) links to a place in the tree become relative."""
    raw = os.readlink(path)
    try:
        real = path.resolve(strict=True)
        real.relative_to(real_root)
    except (OSError, ValueError, RuntimeError):
        return None
    depth = len(name.parts) - 1
    for part in PurePosixPath(raw).parts:
        depth += -1 if part == ".." else 0 if part in (".", "/") else 1
        if depth < 0 or part == "/":
            return os.path.relpath(real, real_root / name.parent)
    return raw


def _add_tree(
    tar: tarfile.TarFile,
    root: Path,
    prefix: str,
    skip: frozenset[str],
    leave_out: tuple[PurePosixPath, ...] = (),
) -> ArchiveStats:
    files = size = left_out = 0
    real_root = root.resolve()
    secrets: list[str] = []
    for name, path in _walk(root, leave_out, secrets) if not skip else _walk_all(root, skip):
        arcname = f"{prefix}/{name}" if prefix else str(name)
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            text = _link_text(path, name, real_root)
            if text is None:
                left_out += 1
                continue
            tar.addfile(_info(arcname, st, tarfile.SYMTYPE, text))
        elif stat.S_ISDIR(st.st_mode):
            tar.addfile(_info(arcname, st, tarfile.DIRTYPE))
        else:
            info = _info(arcname, st, tarfile.REGTYPE)
            with path.open("rb") as f:
                data = f.read()
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            files += 1
            size += len(data)
    return ArchiveStats(files, size, left_out, tuple(secrets))


def _walk_all(root: Path, skip: frozenset[str]) -> Iterator[tuple[PurePosixPath, Path]]:
    """A whole local package (no ignore files), minus `skip` names and links leaving it, sorted."""
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip and d not in ALWAYS_SKIPPED)
        here = Path(dirpath)
        rel = here.relative_to(root)
        for name in sorted([*dirs, *files]):
            path = here / name
            if name in skip or name.endswith(".pyc"):
                continue
            if not path.is_symlink() and not (path.is_file() or path.is_dir()):
                continue
            yield PurePosixPath(rel / name), path


def scan(root: Path, leave_out: tuple[PurePosixPath, ...] = ()) -> ArchiveStats:
    """What `pack(root)` would hold (files and their bytes), without reading them."""
    files = size = 0
    secrets: list[str] = []
    biggest: list[tuple[int, str]] = []  # a min-heap of the LARGEST_SHOWN biggest
    for name, path in _walk(root, leave_out, secrets):
        st = path.lstat()
        if stat.S_ISREG(st.st_mode):
            files, size = files + 1, size + st.st_size
            if len(biggest) < LARGEST_SHOWN:
                heapq.heappush(biggest, (st.st_size, str(name)))
            elif st.st_size > biggest[0][0]:
                heapq.heapreplace(biggest, (st.st_size, str(name)))
    largest = tuple((n, b) for b, n in sorted(biggest, reverse=True))
    return ArchiveStats(files, size, secrets_left_out=tuple(secrets), largest=largest)


def inside(root: Path, path: Path) -> PurePosixPath | None:
    """`path` relative to `root` when it lies in that tree (links resolved), else None: what a
    `leave_out` names."""
    try:
        return PurePosixPath(path.expanduser().resolve().relative_to(root.resolve()))
    except (OSError, ValueError, RuntimeError):
        return None


def pack_with_stats(
    root: Path | None,
    *,
    extra_files: Mapping[str, bytes] | None = None,
    extra_trees: Mapping[str, Path] | None = None,
    leave_out: tuple[PurePosixPath, ...] = (),
) -> tuple[bytes, ArchiveStats]:
    """`pack`, and how many files and bytes went in; `leave_out`: paths of `root` (relative to
    it) not to ship, as the secret patterns are not (an ignore file's `!` line re-includes)."""
    raw = io.BytesIO()
    files = size = left_out = 0
    secrets: tuple[str, ...] = ()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if root is not None:
            if not root.is_dir():
                raise NotADirectoryError(f"{root}: not a directory")
            got = _add_tree(tar, root, "", frozenset(), leave_out)
            files, size, left_out = files + got.files, size + got.bytes_in, left_out + got.links_left_out
            secrets = got.secrets_left_out
        for prefix, tree in sorted((extra_trees or {}).items()):
            clean = str(PurePosixPath(prefix)).strip("/")
            got = _add_tree(tar, tree, clean, TREE_SKIPPED)
            files, size, left_out = files + got.files, size + got.bytes_in, left_out + got.links_left_out
        for name, data in sorted((extra_files or {}).items()):
            info = tarfile.TarInfo(str(PurePosixPath(name)).lstrip("/"))
            info.mtime, info.mode, info.size = 0, 0o644, len(data)
            tar.addfile(info, io.BytesIO(data))
            files, size = files + 1, size + len(data)
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=6, filename="") as gz:
        gz.write(raw.getvalue())
    return out.getvalue(), ArchiveStats(files, size, left_out, secrets)


def pack(
    root: Path | None,
    *,
    extra_files: Mapping[str, bytes] | None = None,
    extra_trees: Mapping[str, Path] | None = None,
) -> bytes:
    """A deterministic tar.gz of `root` (ignore files honoured), plus `extra_files` (archive name →
    bytes) and `extra_trees` (archive prefix → a local directory, shipped whole minus __pycache__)."""
    return pack_with_stats(root, extra_files=extra_files, extra_trees=extra_trees)[0]
