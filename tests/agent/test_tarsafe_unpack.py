"""Unpacking a code archive and packing files back on a root agent, for real: a tenant's Unix user,
GNU tar, data dirs the tenant may not pass. The exploits are the published ones (a link chain past
PATH_MAX; a link planted where the agent writes the CA copy); each must leave the host untouched."""

from __future__ import annotations

import gzip
import io
import os
import pwd
import shutil
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.blobs import BlobCache, CodeUnavailable, tenant_user
from computepool.agent.executor import Executor
from computepool.agent.jobfiles import pack_as, unpack_as, write_job_file
from computepool.agent.jobstart import WORKER_CA_FILE, JobStarter
from computepool.agent.sandbox import SandboxConfig
from computepool.agent.tenants import ensure_tenant_user, remove_tenant_user
from computepool.core.tarsafe import sha256_hex

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need root")

RANGE = (61000, 61999)


@pytest.fixture
def tenant() -> Iterator[str]:
    name = f"tz{uuid.uuid4().hex[:8]}"
    yield name
    remove_tenant_user(name, RANGE)


@pytest.fixture
def root_dir() -> Iterator[Path]:
    """A root-owned 0700 directory (like /root/.computepool): no tenant may pass it."""
    d = Path("/var/tmp") / f"cpool-tarfix-{uuid.uuid4().hex[:8]}"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def victim() -> Iterator[Path]:
    """A root-owned directory others may read and pass but not write, holding a file of root's."""
    d = Path("/var/tmp") / f"cpool-victim-{uuid.uuid4().hex[:8]}"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    (d / "precious").write_text("root's\n")
    os.chmod(d / "precious", 0o600)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def cache_with(root_dir: Path, data: bytes, **kw: object) -> tuple[BlobCache, str]:
    """A BlobCache already holding `data` (so no control plane is asked for it)."""
    cache = BlobCache(root_dir / "agent", None, sandbox=SandboxConfig(uid_range=RANGE), **kw)  # type: ignore[arg-type]
    cache.dir.mkdir(parents=True, mode=0o700)
    sha = sha256_hex(data)
    cache.path(sha).write_bytes(data)
    return cache, sha


def work_dir(root_dir: Path) -> Path:
    work = root_dir / "agent" / "runs" / "1" / "1" / "work"
    work.mkdir(parents=True)
    for d in (root_dir / "agent", root_dir / "agent" / "runs", *work.parents[:3]):
        os.chmod(d, 0o700)  # the agent's umask: nothing on the way is the tenant's to pass
    return work


def tgz(members: list[tuple[str, str, str]]) -> bytes:
    """(name, kind: file|dir|sym, data or link target) → tar.gz."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, text in members:
            info = tarfile.TarInfo(name)
            if kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, text
                tar.addfile(info)
            elif kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(text), 0o644
                tar.addfile(info, io.BytesIO(text.encode()))
    return raw.getvalue()


def path_max_exploit(target: Path) -> bytes:
    """The reviewer's archive: nested 247-byte dirs with one-letter links to them, a link through
    the chain that climbs back past PATH_MAX, and a file written through `escape` into `target`."""
    comp, steps, path = "d" * 247, "abcdefghijklmnop", ""
    members: list[tuple[str, str, str]] = []
    for step in steps:
        members += [(os.path.join(path, comp), "dir", ""), (os.path.join(path, step), "sym", comp)]
        path = os.path.join(path, comp)
    linkpath = os.path.join(*steps, "l" * 254)
    members.append((linkpath, "sym", os.path.join(*[".."] * len(steps))))
    members.append(("escape", "sym", linkpath + "/.." * 17 + str(target)))
    members.append(("escape/pwned", "file", "written as root through a code archive\n"))
    return tgz(members)


def test_the_path_max_exploit_writes_nothing_outside_the_work_dir(
    root_dir: Path, victim: Path, tenant: str
) -> None:
    cache, sha = cache_with(root_dir, path_max_exploit(victim))
    work = work_dir(root_dir)
    with pytest.raises(CodeUnavailable, match="code: refused the archive"):
        cache.unpack_code(sha, work, tenant)
    assert sorted(p.name for p in victim.iterdir()) == ["precious"]
    assert list(work.iterdir()) == []


def test_code_is_unpacked_as_the_tenant_through_a_dir_it_cannot_pass(root_dir: Path, tenant: str) -> None:
    data = tgz([("src", "dir", ""), ("src/m.py", "file", "X = 1\n"), ("run", "sym", "src/m.py")])
    cache, sha = cache_with(root_dir, data)
    work = work_dir(root_dir)
    assert cache.unpack_code(sha, work, tenant) == 3
    user = pwd.getpwnam(f"cpool-{tenant}")
    for p in (work, work / "src", work / "src" / "m.py", work / "run"):
        assert p.lstat().st_uid == user.pw_uid, p  # written by the tenant's tar, not chowned after
    assert (work / "run").read_text() == "X = 1\n"
    assert (work.stat().st_mode & 0o777) == 0o700


def test_the_kernel_stops_the_tenants_tar_where_the_check_would_not(root_dir: Path, victim: Path) -> None:
    """Depth: were a link to a directory of root's already in the work dir (one the checker and tar
    could not have seen, say), the tenant's tar follows it and the kernel refuses the write."""
    user = ensure_tenant_user(f"tk{uuid.uuid4().hex[:8]}", RANGE)
    try:
        blob = root_dir / "blob"
        blob.write_bytes(tgz([("esc/pwned", "file", "x"), ("ok", "file", "y")]))
        work = work_dir(root_dir)
        os.symlink(victim, work / "esc")
        with (
            pytest.raises(
                ValueError, match="unpacking failed: tar: esc/pwned: Cannot open: Permission denied"
            ),
            gzip.open(blob) as tar,
        ):
            unpack_as(user, tar, work, 1 << 20)  # type: ignore[arg-type]
        assert sorted(p.name for p in victim.iterdir()) == ["precious"]
        assert (work / "ok").read_text() == "y"  # the rest was unpacked, as the tenant
    finally:
        remove_tenant_user(user.pw_gecos.removeprefix("computepool tenant "), RANGE)


def test_caps_on_unpacked_bytes(root_dir: Path, tenant: str) -> None:
    data = tgz([("a", "file", "x" * 10), ("b", "file", "y" * 10)])
    cache, sha = cache_with(root_dir, data, max_unpacked=15)
    with pytest.raises(CodeUnavailable, match="unpacks to more than 15 bytes"):
        cache.unpack_code(sha, work_dir(root_dir), tenant)


def test_the_ca_copy_replaces_a_planted_link_instead_of_following_it(
    root_dir: Path, victim: Path, tenant: str, executor: Executor
) -> None:
    """`.cpool-ca.pem -> /host/file` in the work dir (the checker refuses such an archive: planted
    here as a bypass would): the agent's CA copy must replace the link, not write through it."""
    data = tgz([(WORKER_CA_FILE, "sym", str(victim / "precious"))])
    cache, sha = cache_with(root_dir, data)
    work = work_dir(root_dir)
    with pytest.raises(CodeUnavailable, match="absolute"):
        cache.unpack_code(sha, work, tenant)
    os.symlink(victim / "precious", work / WORKER_CA_FILE)
    ca = root_dir / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    starter = JobStarter("n", None, executor, root_dir, None, server="http://cp", ca=ca)  # type: ignore[arg-type]
    env = starter.worker_env({"CPOOL_WORKER_TOKEN": "t"}, work)
    assert env["CPOOL_CA"] == str(work / WORKER_CA_FILE)
    assert not (work / WORKER_CA_FILE).is_symlink()
    assert (work / WORKER_CA_FILE).read_text() == ca.read_text()
    assert (victim / "precious").read_text() == "root's\n"
    assert ((victim / "precious").stat().st_mode & 0o777) == 0o600
    (work / "dir").mkdir()
    with pytest.raises(OSError):
        write_job_file(work, "dir", b"x")


def test_files_back_are_packed_as_the_tenant_through_a_dir_it_cannot_pass(
    root_dir: Path, tenant: str
) -> None:
    user = ensure_tenant_user(tenant, RANGE)
    work = work_dir(root_dir)
    os.chown(work, user.pw_uid, user.pw_gid)
    (work / "out").mkdir()
    (work / "out" / "r.txt").write_text("42\n")
    os.link(work / "out" / "r.txt", work / "out" / "same.txt")  # two names: both travel as files
    (work / "secret").write_text("root's\n")
    os.chmod(work / "secret", 0o600)  # root's file in the tenant's dir: the tenant's tar cannot read it
    out = root_dir / "out.tgz"
    pack_as(user, work, "out", out)
    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == ["out", "out/r.txt", "out/same.txt"]
        assert all(not m.islnk() for m in tar.getmembers())
    with pytest.raises(ValueError, match=r"^secret: tar: secret: Cannot open: Permission denied"):
        pack_as(user, work, "secret", out)  # tar's first complaint, not its closing summary


def test_files_are_never_read_as_root_for_a_tenant_without_a_user() -> None:
    with pytest.raises(ValueError, match="no Unix user on this node"):
        tenant_user(f"none{uuid.uuid4().hex[:8]}")


def test_blobs_no_job_used_for_a_day_are_pruned(root_dir: Path, tenant: str) -> None:
    cache, old = cache_with(root_dir, tgz([("a", "file", "old")]))
    _, fresh = cache_with_more(cache, tgz([("b", "file", "fresh")]))
    _, used = cache_with_more(cache, tgz([("c", "file", "used")]))
    day_ago = time.time() - 25 * 3600
    for sha in (old, fresh, used):
        os.utime(cache.path(sha), (day_ago, day_ago))
    os.utime(cache.path(fresh))
    partial = cache.dir / ".fetch-leftover"
    partial.write_bytes(b"")
    os.utime(partial, (day_ago, day_ago))
    cache.unpack_code(used, work_dir(root_dir), tenant)  # a use marks it, then prunes
    assert not cache.path(old).exists() and not partial.exists()
    assert cache.path(fresh).exists() and cache.path(used).exists()
    assert cache.prune() == 0  # at most every ten minutes


def cache_with_more(cache: BlobCache, data: bytes) -> tuple[BlobCache, str]:
    sha = sha256_hex(data)
    cache.path(sha).write_bytes(data)
    return cache, sha


def test_packing_files_back_stops_at_its_cap(tmp_path: Path) -> None:
    """A job that wrote more than a fetch may carry is refused while packing, not packed whole."""
    work = tmp_path / "work"
    (work / "out").mkdir(parents=True)
    (work / "out" / "big.bin").write_bytes(os.urandom(3 << 20))  # random: gzip cannot shrink it
    with pytest.raises(ValueError, match="more than 1 MiB packed"):
        pack_as(None, work, "out", tmp_path / "a.tar.gz", 1 << 20)
    assert (tmp_path / "a.tar.gz").stat().st_size <= 1 << 20
    pack_as(None, work, "out", tmp_path / "b.tar.gz", 8 << 20)  # under the cap: packed
    with tarfile.open(tmp_path / "b.tar.gz") as t:
        assert t.getmember("out/big.bin").size == 3 << 20
