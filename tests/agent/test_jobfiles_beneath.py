"""Walking a path asked back beneath the job's work dir: never through a link, whatever the job
puts or swaps in on the way, and the archive named as the path asked for."""

from __future__ import annotations

import os
import shutil
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.jobfiles import dir_fd, open_beneath, pack_as, run_tar
from computepool.agent.tenants import ensure_tenant_user, remove_tenant_user

RANGE = (61000, 61999)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A work dir holding `a/b/f`, next to a file of the host's it must never give away."""
    w = tmp_path / "work"
    (w / "a" / "b").mkdir(parents=True)
    (w / "a" / "b" / "f").write_text("the job's\n")
    (tmp_path / "host").mkdir()
    (tmp_path / "host" / "b").mkdir()
    (tmp_path / "host" / "b" / "f").write_text("the host's\n")
    return w


def names(archive: Path) -> dict[str, str]:
    """member name → its text (a file), "dir", or "-> target" (a link)."""
    out: dict[str, str] = {}
    with tarfile.open(archive) as t:
        for m in t.getmembers():
            f = t.extractfile(m) if m.isfile() else None
            out[m.name] = f.read().decode() if f else ("dir" if m.isdir() else f"-> {m.linkname}")
    return out


def test_a_link_in_the_middle_is_refused_even_to_inside(work: Path, tmp_path: Path) -> None:
    os.symlink(tmp_path / "host", work / "out")
    os.symlink("a", work / "in")  # a link that stays inside is not walked through either
    with dir_fd(work) as wfd:
        for rel in ("out/b/f", "in/b/f", "a/../out/b/f"):
            with pytest.raises(ValueError) as e, open_beneath(wfd, rel):
                pass
            assert str(e.value).startswith(f"{rel}: ")
    with pytest.raises(ValueError, match=r"^out/b/f: out is a symbolic link: links on the way"):
        pack_as(None, work, "out/b/f", tmp_path / "x.tgz")
    with pytest.raises(ValueError, match=r"^in/b: in is a symbolic link"):
        pack_as(None, work, "in/b", tmp_path / "x.tgz")


@pytest.mark.parametrize("rel", ["..", "a/../../host/b/f", "a/b/..", "/etc/passwd", "/"])
def test_dot_dot_and_absolute_paths_are_refused(work: Path, tmp_path: Path, rel: str) -> None:
    with pytest.raises(ValueError, match="must be a path inside the job's work dir"):
        pack_as(None, work, rel, tmp_path / "x.tgz")


def test_missing_names_and_files_on_the_way_say_which(work: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^a/nope: no such file or directory in the job's work dir$"):
        pack_as(None, work, "a/nope", tmp_path / "x.tgz")
    with pytest.raises(
        ValueError, match=r"^a/nope/f: no such file or directory in the job's work dir \(a/nope\)"
    ):
        pack_as(None, work, "a/nope/f", tmp_path / "x.tgz")
    with pytest.raises(ValueError, match=r"^a/b/f/g: a/b/f is not a directory$"):
        pack_as(None, work, "a/b/f/g", tmp_path / "x.tgz")


def test_a_file_replaced_by_a_link_travels_as_the_link_never_its_target(work: Path, tmp_path: Path) -> None:
    pack_as(None, work, "a/b/f", tmp_path / "before.tgz")
    assert names(tmp_path / "before.tgz") == {"a/b/f": "the job's\n"}
    (work / "a" / "b" / "f").unlink()
    os.symlink(tmp_path / "host" / "b" / "f", work / "a" / "b" / "f")
    pack_as(None, work, "a/b/f", tmp_path / "after.tgz")
    assert names(tmp_path / "after.tgz") == {"a/b/f": f"-> {tmp_path / 'host' / 'b' / 'f'}"}
    pack_as(None, work, "a", tmp_path / "dir.tgz")  # below the path asked for: links kept as links
    assert names(tmp_path / "dir.tgz")["a/b/f"] == f"-> {tmp_path / 'host' / 'b' / 'f'}"


def test_a_directory_swapped_for_a_link_after_the_walk_is_still_the_one_read(
    work: Path, tmp_path: Path
) -> None:
    """What was opened is what is packed: the job renaming a link into its place changes nothing."""
    with dir_fd(work) as wfd, open_beneath(wfd, "a/b/f") as at:
        assert (at.name, at.prefix) == ("f", "a/b/")
        os.rename(work / "a", work / "a.old")
        os.symlink(tmp_path / "host", work / "a")
        with (tmp_path / "x.tar").open("wb") as out:
            r = run_tar(None, at.dir_fd, ["--create", "--file", "-", "--", at.name], stdout=out.fileno())
    assert r.returncode == 0, r.stderr
    with tarfile.open(tmp_path / "x.tar") as t:
        f = t.extractfile("f")
        assert f is not None and f.read() == b"the job's\n"


@pytest.mark.parametrize("odd", ["x,y", "a&b", "back\\slash", "\\1", "sp ace", "ü", "-x", "*"])
def test_the_archive_names_the_path_asked_for(work: Path, tmp_path: Path, odd: str) -> None:
    (work / "a" / "b").rename(work / "a" / odd)
    os.symlink("../../a", work / "a" / odd / "up")  # a link's target is left as it is
    pack_as(None, work, f"./a//{odd}/", tmp_path / "x.tgz")
    assert names(tmp_path / "x.tgz") == {
        f"a/{odd}": "dir",
        f"a/{odd}/f": "the job's\n",
        f"a/{odd}/up": "-> ../../a",
    }
    pack_as(None, work, f"a/{odd}/up", tmp_path / "up.tgz")  # the odd name on the way
    assert names(tmp_path / "up.tgz") == {f"a/{odd}/up": "-> ../../a"}
    (work / odd).mkdir()
    (work / odd / odd).write_text("odd\n")
    pack_as(None, work, f"{odd}/{odd}", tmp_path / "odd.tgz")
    assert names(tmp_path / "odd.tgz") == {f"{odd}/{odd}": "odd\n"}
    pack_as(None, work, ".", tmp_path / "all.tgz")
    assert names(tmp_path / "all.tgz")[f"./a/{odd}/f"] == "the job's\n"


@pytest.fixture
def root_dir() -> Iterator[Path]:
    d = Path("/var/tmp") / f"cpool-beneath-{uuid.uuid4().hex[:8]}"
    d.mkdir(mode=0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need root")
def test_a_tenant_packs_a_nested_path_through_a_dir_it_cannot_pass(root_dir: Path) -> None:
    """The tenant's tar reopens the walked directory (an O_PATH descriptor) as the tenant: the dirs
    above the work dir stay closed to it, and a file of root's in its dir stays unread."""
    tenant = f"tb{uuid.uuid4().hex[:8]}"
    try:
        user = ensure_tenant_user(tenant, RANGE)
        work = root_dir / "w"
        (work / "a" / "b").mkdir(parents=True)
        (work / "a" / "b" / "f").write_text("the job's\n")
        (work / "a" / "b" / "secret").write_text("root's\n")
        os.chmod(work / "a" / "b" / "secret", 0o600)
        for d in (work, work / "a", work / "a" / "b", work / "a" / "b" / "f"):
            os.chown(d, user.pw_uid, user.pw_gid)
        pack_as(user, work, "a/b/f", root_dir / "f.tgz")
        assert names(root_dir / "f.tgz") == {"a/b/f": "the job's\n"}
        with pytest.raises(ValueError, match=r"^a/b/secret: tar: secret: Cannot open: Permission denied"):
            pack_as(user, work, "a/b/secret", root_dir / "s.tgz")
    finally:
        remove_tenant_user(tenant, RANGE)


def test_tar_runs_at_the_lowest_priority(tmp_path: Path) -> None:
    """Packing runs outside every job's cgroup: at niceness 19 it takes only the CPU jobs leave idle
    (a tenant asking for a huge sparse file again and again slows nobody's job)."""
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "a").write_text("x")
    seen = tmp_path / "nice"
    probe = f"--checkpoint-action=exec=cut -d' ' -f19 /proc/self/stat > {seen}"
    with dir_fd(tmp_path / "work") as fd:
        r = run_tar(None, fd, ["--checkpoint=1", probe, "-cf", "/dev/null", "."])
    assert r.returncode == 0, r.stderr
    assert seen.read_text().strip() == "19"
