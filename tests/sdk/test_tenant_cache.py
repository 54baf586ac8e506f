"""The agent's side of functions, with real tenant users and namespaces: every sandboxed job gets its
tenant's cache dir (CPOOL_CACHE_DIR), kept between jobs, its tenant's alone, reachable even where the
sandbox hides everything above it; and the node's Pythons a tenant can run are found."""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec, SandboxConfig
from computepool.agent.join import tenant_pythons
from computepool.agent.localstate import JobState
from computepool.agent.tenants import remove_tenant_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and namespaces need root")

PY = "/usr/bin/python3"
RANGE = (61000, 61999)
JOB = r"""
import json, os, sys
cache = os.environ["CPOOL_CACHE_DIR"]
mark = os.path.join(cache, "mark")
before = open(mark).read() if os.path.exists(mark) else None
open(mark, "w").write(sys.argv[1])
others = {}
for name in os.listdir(os.path.dirname(cache)) if os.access(os.path.dirname(cache), os.R_OK) else []:
    others[name] = "listed"
try:
    os.listdir(sys.argv[2])
    others["other tenant's cache"] = "listed"
except OSError as e:
    others["other tenant's cache"] = type(e).__name__
print(json.dumps({"cache": cache, "before": before, "others": others}))
"""


@pytest.fixture
def root() -> Iterator[Path]:
    """A 0700 dir: the sandbox hides it whole, so the job's dirs must be bound back in."""
    d = Path("/var/tmp") / f"cpool-cache-{uuid.uuid4().hex[:8]}"
    d.mkdir(mode=0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tenants() -> Iterator[list[str]]:
    names = [f"c{uuid.uuid4().hex[:8]}", f"c{uuid.uuid4().hex[:8]}"]
    yield names
    for n in names:
        remove_tenant_user(n, RANGE)


def test_each_tenant_has_a_cache_of_its_own_that_outlives_its_jobs(root: Path, tenants: list[str]) -> None:
    cache_root = root / "cache"
    ex = Executor(root / "agent", cgroup_base=None, kill_grace_s=2.0,
                  sandbox=SandboxConfig(uid_range=RANGE, cache_root=cache_root))  # fmt: skip
    try:
        seen = []
        for i, tenant in enumerate([tenants[0], tenants[0], tenants[1]]):
            other = cache_root / tenants[0]
            argv = [PY, "-c", JOB, f"job{i}", str(other)]
            rec = ex.start(JobSpec(f"c{i}", 1, argv, tenant=tenant))
            done = ex.wait(rec.key, 30)
            out = (Path(done.run_dir) / STDOUT_LOG).read_text()
            assert done.state is JobState.SUCCEEDED, (done.reason, out)
            seen.append(json.loads(out))
    finally:
        ex.state.close()
    first, second, stranger = seen
    assert first["cache"] == second["cache"] == str(cache_root / tenants[0])
    assert (first["before"], second["before"]) == (None, "job0")  # kept between jobs
    assert stranger["cache"] == str(cache_root / tenants[1]) and stranger["before"] is None
    # another tenant's cache is out of reach (here not even there: the sandbox shows only its own)
    assert stranger["others"].pop("other tenant's cache") in ("PermissionError", "FileNotFoundError")
    assert set(stranger["others"]) <= {tenants[1]}
    assert first["others"]["other tenant's cache"] == "listed"  # its own
    assert stat.S_IMODE(cache_root.stat().st_mode) == 0o711 and cache_root.stat().st_uid == 0
    for t in tenants:
        st = (cache_root / t).stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid != 0


def test_the_pythons_a_tenant_can_run_are_reported(root: Path) -> None:
    root.chmod(0o755)  # (pytest's tmp_path lies under a 0700 dir: nothing there is anyone's to run)
    tmp_path = root
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3.11").symlink_to("/usr/bin/python3.11")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "python3.12").write_text("#!/bin/sh\n")
    (private / "python3.12").chmod(0o755)
    (bin_dir / "python3.12").symlink_to(private / "python3.12")  # leads where no tenant may pass
    (bin_dir / "python3.13").write_text("#!/bin/sh\n")
    (bin_dir / "python3.13").chmod(0o700)  # no one else may run it
    (bin_dir / "python3.14-config").write_text("")
    assert tenant_pythons(f"{bin_dir}:/nonexistent") == ["3.11"]
    assert "3.11" in tenant_pythons()
