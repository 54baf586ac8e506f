"""The code archive: deterministic bytes, git's ignore rules, and safe unpacking on both ends."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path, PurePosixPath

import pytest

from computepool.client.archive import (
    FETCHED_FILE,
    inside,
    pack,
    pack_with_stats,
    remember_fetched,
    safe_extract,
    scan,
)
from computepool.core.tarsafe import UnsafeArchive


def tree(root: Path) -> Path:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "m.py").write_text("X = 1\n")
    (root / "src" / "notes.log").write_text("log\n")
    (root / "src" / "keep.log").write_text("kept\n")
    (root / "src" / ".gitignore").write_text("*.tmp\n")
    (root / "src" / "scratch.tmp").write_text("tmp\n")
    (root / "build").mkdir()
    (root / "build" / "out.o").write_text("o\n")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref\n")
    (root / ".gitignore").write_text("*.log\n!keep.log\nbuild/\n")
    (root / ".cpoolignore").write_text("data/\n")
    (root / "data").mkdir()
    (root / "data" / "big").write_text("big\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    os.symlink("/etc/passwd", root / "outside")
    os.symlink("src/pkg/m.py", root / "inside")
    return root


def names(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return tar.getnames()


def test_pack_honours_ignore_files_and_is_deterministic(tmp_path: Path) -> None:
    root = tree(tmp_path / "p")
    data, stats = pack_with_stats(root)
    assert names(data) == [
        ".cpoolignore", ".gitignore", "inside", "run.sh", "src", "src/.gitignore", "src/keep.log",
        "src/pkg", "src/pkg/m.py",
    ]  # fmt: skip
    assert stats.files == 6 and scan(root).files == 6
    os.utime(root / "run.sh", (1, 1))  # times and owners do not change the bytes
    assert pack(root) == data
    (root / "src" / "pkg" / "m.py").write_text("X = 2\n")
    assert pack(root) != data
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        run = tar.getmember("run.sh")
        assert run.mode == 0o755 and run.mtime == 0 and run.uid == 0 and run.uname == ""


def test_extra_files_and_trees(tmp_path: Path) -> None:
    pkg = tmp_path / "lib" / "mylib"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__pycache__" / "x.pyc").write_bytes(b"\0")
    data = pack(None, extra_files={"fn.pkl": b"abc"}, extra_trees={"site/mylib": pkg})
    assert names(data) == ["site/mylib/__init__.py", "fn.pkl"]
    out = tmp_path / "out"
    safe_extract(data, out)
    assert (out / "fn.pkl").read_bytes() == b"abc" and (out / "site" / "mylib" / "__init__.py").exists()


@pytest.mark.parametrize(
    ("member", "why"),
    [("../escape", "'..'"), ("/abs", "absolute"), ("link:/etc", "outside"), ("link:../../x", "outside"),
     ("fifo", "special files")],
)  # fmt: skip
def test_unsafe_archives_are_refused(tmp_path: Path, member: str, why: str) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        if member.startswith("link:"):
            info = tarfile.TarInfo("sub/l")
            info.type, info.linkname = tarfile.SYMTYPE, member[5:]
            tar.addfile(info)
        elif member == "fifo":
            info = tarfile.TarInfo("f")
            info.type = tarfile.FIFOTYPE
            tar.addfile(info)
        else:
            info = tarfile.TarInfo(member)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    dest = tmp_path / "d"
    with pytest.raises(UnsafeArchive, match=why):
        safe_extract(raw.getvalue(), dest)
    assert not (tmp_path / "escape").exists() and not (dest / "sub" / "l").is_symlink()
    with pytest.raises(UnsafeArchive, match="not a readable tar"):
        safe_extract(b"not a tar at all", dest)


def test_links_in_the_tree_ship_as_relative_links_and_links_out_are_counted(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "data" / "set").mkdir(parents=True)
    (real / "data" / "set" / "x.csv").write_text("1,2\n")
    (real / "sub").mkdir()
    os.symlink(real / "data" / "set", real / "sub" / "abs")  # absolute, inside the tree
    os.symlink("../../real/data/set/x.csv", real / "sub" / "climbs")  # relative, leaves and comes back
    os.symlink("../data/set/x.csv", real / "sub" / "plain")  # relative, inside: kept as written
    os.symlink(tmp_path, real / "up")  # leads out
    os.symlink(real / "nowhere", real / "dangling")
    via = tmp_path / "via"
    os.symlink(real, via)  # the directory reached through a link: the tree's links still judged right
    data, stats = pack_with_stats(via)
    assert stats.links_left_out == 2  # `up` and `dangling`
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        links = {m.name: m.linkname for m in tar.getmembers() if m.issym()}
    assert links == {
        "sub/abs": "../data/set",
        "sub/climbs": "../data/set/x.csv",
        "sub/plain": "../data/set/x.csv",
    }
    out = tmp_path / "out"
    safe_extract(data, out)  # the agent's rules accept every one of them
    assert (out / "sub" / "abs" / "x.csv").read_text() == "1,2\n"
    assert (out / "sub" / "climbs").read_text() == "1,2\n"


def test_secret_files_and_the_named_paths_are_left_out_unless_an_ignore_file_re_includes_them(
    tmp_path: Path,
) -> None:
    root = tmp_path / "p"
    (root / "conf").mkdir(parents=True)
    for name in (".env", ".env.prod", "conf/server.pem", "conf/tls.key", "id_ed25519", "id_ed25519.pub",
                 "id_utils.py", "main.py", "conf/my vars[1]", "conf/public.pem"):  # fmt: skip
        (root / name).write_text("x\n")
    (root / ".cpoolignore").write_text("!public.pem\n")
    leave = (PurePosixPath("conf/my vars[1]"),)
    data, stats = pack_with_stats(root, leave_out=leave)
    assert names(data) == [
        ".cpoolignore",
        "conf",
        "conf/public.pem",
        "id_ed25519.pub",
        "id_utils.py",
        "main.py",
    ]
    left = [".env", ".env.prod", "conf/my vars[1]", "conf/server.pem", "conf/tls.key", "id_ed25519"]
    assert sorted(stats.secrets_left_out) == left
    assert sorted(scan(root, leave).secrets_left_out) == left
    # a name git already ignores is not reported as left out by the secret rules
    (root / ".gitignore").write_text(".env\n")
    assert ".env" not in pack_with_stats(root)[1].secrets_left_out
    assert inside(root, root / "conf" / ".." / ".env") == PurePosixPath(".env")
    assert inside(root, tmp_path / "elsewhere.env") is None


def test_scan_names_the_biggest_files_without_reading_them(tmp_path: Path) -> None:
    """Sizes come from the directory entries: sparse files of gigabytes cost nothing to scan."""
    (tmp_path / "sub").mkdir()
    for name, size in (("a.bin", 3 << 30), ("sub/b.ckpt", 5 << 30), ("c.txt", 10), ("d.bin", 1 << 30)):
        with open(tmp_path / name, "wb") as f:
            f.truncate(size)
    (tmp_path / ".cpoolignore").write_text("d.bin\n")
    seen = scan(tmp_path)
    assert seen.files == 4 and seen.bytes_in == (8 << 30) + 10 + len("d.bin\n")
    assert seen.largest == (("sub/b.ckpt", 5 << 30), ("a.bin", 3 << 30), ("c.txt", 10))


def test_what_output_brought_back_is_not_shipped_again_unless_re_included(tmp_path: Path) -> None:
    root = tree(tmp_path / "p")
    (root / "results").mkdir()
    (root / "results" / "model.bin").write_text("weights\n")
    (root / "score.txt").write_text("0.9\n")
    before = names(pack(root))
    assert "results/model.bin" in before and "score.txt" in before
    remember_fetched(root, "results/")
    remember_fetched(root, "score.txt")
    remember_fetched(root, "score.txt")  # once is enough
    assert (root / FETCHED_FILE).read_text() == "results\nscore.txt\n"
    after = names(pack(root))
    assert "results" not in after and "score.txt" not in after and FETCHED_FILE not in after
    assert set(before) - set(after) == {"results", "results/model.bin", "score.txt"}
    (root / ".cpoolignore").write_text("data/\n!score.txt\n")  # the user's own word wins
    assert "score.txt" in names(pack(root))
