"""A tenant's process races the agent's chown of its next job's work dir to take a file of root's.

Before a job starts, the root agent hands everything in the job's `work/` to the tenant's user
(sandbox.prepare_dirs). The tenant's code is already unpacked there, as the tenant, and the
directory is the tenant's: a process of the tenant that can reach it (a job on a host that refuses
namespaces, where the agent's data dir is not covered) swaps a directory of its with a link to a
directory of root's (renameat2 RENAME_EXCHANGE) while the agent walks the tree. The agent listed
the real directory, then chowned `work/d/NAME` by path: through the link, root's file became the
tenant's. It now walks from descriptors and changes each name relative to the directory it listed,
never through a link.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.sandbox import prepare_dirs

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the chown is root's"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the racer uses x86_64's renameat2 number"),
]

UID = 61997
PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"  # one any user may run
FILES = 300
RACER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
work = sys.argv[1]
a, b = os.path.join(work, "d").encode(), os.path.join(work, "l").encode()
print("racing", flush=True)
while True:
    libc.syscall(316, -100, a, -100, b, 2)  # renameat2(AT_FDCWD, d, AT_FDCWD, l, RENAME_EXCHANGE)
"""


@pytest.fixture
def place() -> Iterator[Path]:
    top = Path("/var/tmp") / f"cpool-race-{uuid.uuid4().hex[:8]}"
    top.mkdir(mode=0o755)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def test_a_link_swapped_in_during_the_chown_gives_the_tenant_no_file_of_roots(place: Path) -> None:
    roots = place / "roots"  # stands for /etc: a directory of root's with files of root's
    roots.mkdir()
    for i in range(FILES):
        (roots / f"f{i}").write_text("root's")
    run_dir = place / "runs" / "7" / "1"
    work = prepare_dirs(run_dir, UID, UID)
    (work / "d").mkdir()
    for i in range(FILES):
        (work / "d" / f"f{i}").write_text("the tenant's")
    os.symlink(roots, work / "l")
    for p in (work / "d", *(work / "d").iterdir()):
        os.chown(p, UID, UID)
    os.lchown(work / "l", UID, UID)
    racer = subprocess.Popen(
        [PY, "-I", "-c", RACER, str(work)], user=UID, group=UID, extra_groups=[],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert racer.stdout is not None and racer.stdout.readline().strip() == "racing"
        for _ in range(40):
            prepare_dirs(run_dir, UID, UID)
            taken = [p.name for p in roots.iterdir() if p.stat().st_uid != 0]
            assert taken == [], f"root's files handed to the tenant through the link: {taken[:5]}"
    finally:
        racer.kill()
        racer.wait()
    # what the agent put in the tenant's real directory is still handed over
    real = work / "d" if not (work / "d").is_symlink() else work / "l"
    (real / "shim.py").write_text("the agent's")
    prepare_dirs(run_dir, UID, UID)
    assert (real / "shim.py").stat().st_uid == UID
    assert all(p.stat().st_uid == 0 for p in roots.iterdir())
