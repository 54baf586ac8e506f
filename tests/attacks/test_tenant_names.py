"""A process job learns which other tenants use the node.

The API answers for another tenant's ids as for missing ones, but a job read every tenant that ever
ran on its node from `/etc/passwd` and `/etc/group` (`cpool-<tenant>`, one user each), and could
tell another tenant's cache from a missing one (`stat` of `/var/cache/computepool/<name>`:
EACCES, not ENOENT). A job now sees copies of both files without the other tenants' users and
groups, and the tenants' caches' root covered: only its own cache is there.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec, SandboxConfig
from computepool.agent.localstate import JobState
from computepool.agent.tenants import remove_tenant_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and namespaces need root")

PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
RANGE = (61000, 61999)
LOOK = r"""
import errno, grp, json, os, pwd, sys
def tried(path):
    try:
        os.stat(path)
        return "there"
    except OSError as e:
        return errno.errorcode[e.errno]
cache = os.environ["CPOOL_CACHE_DIR"]
open(os.path.join(cache, "mine"), "w").write("x")
print(json.dumps({
    "users": [line.split(":")[0] for line in open("/etc/passwd")],
    "groups": [line.split(":")[0] for line in open("/etc/group")],
    "me": pwd.getpwuid(os.getuid()).pw_name,
    "other cache": tried(os.path.join(os.path.dirname(cache), sys.argv[1])),
    "own cache": sorted(os.listdir(cache)),
}))
"""


@pytest.fixture
def node() -> Iterator[tuple[Executor, Path, list[str]]]:
    """A root agent's executor with tenants' caches in a root of its own, and two tenants."""
    data = Path("/var/tmp") / f"cpool-names-{uuid.uuid4().hex[:8]}"
    data.mkdir(mode=0o755)
    caches = Path("/var/lib") / f"cpool-caches-{uuid.uuid4().hex[:8]}"  # outside the job's private /var/tmp
    ex = Executor(
        data / "agent",
        cgroup_base=None,
        kill_grace_s=1.0,
        sandbox=SandboxConfig(uid_range=RANGE, cache_root=caches),
    )
    tenants = [f"a{uuid.uuid4().hex[:8]}", f"b{uuid.uuid4().hex[:8]}"]
    yield ex, caches, tenants
    ex.state.close()
    for t in tenants:
        remove_tenant_user(t, RANGE)
    shutil.rmtree(data, ignore_errors=True)
    shutil.rmtree(caches, ignore_errors=True)


def _run(ex: Executor, key: str, tenant: str, argv: list[str]) -> str:
    done = ex.wait(ex.start(JobSpec(key, 1, argv, tenant=tenant)).key, 20)
    assert done.state is JobState.SUCCEEDED, (done.reason, (Path(done.run_dir) / "stderr.log").read_text())
    return (Path(done.run_dir) / STDOUT_LOG).read_text()


def test_a_job_sees_no_other_tenants_user_group_or_cache(node: tuple[Executor, Path, list[str]]) -> None:
    ex, caches, (a, b) = node
    _run(ex, "a1", a, ["true"])  # A's user and cache exist on the node from now on
    seen = json.loads(_run(ex, "b1", b, [PY, "-c", LOOK, a]))
    a_user, b_user = f"cpool-{a}", f"cpool-{b}"
    assert pwd.getpwnam(a_user) and (caches / a).is_dir()  # they are there, on the host
    assert a_user not in seen["users"] and a_user not in seen["groups"], seen
    assert b_user in seen["users"] and b_user in seen["groups"] and "root" in seen["users"], seen
    assert seen["me"] == b_user
    assert seen["other cache"] == "ENOENT", seen  # as for a tenant that never ran here
    assert seen["own cache"] == ["mine"] and (caches / b / "mine").read_text() == "x"
