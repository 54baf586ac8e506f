"""A tenant's variables against the steps a root agent runs before it drops to the tenant's user.

The attack: a job leaves an executable named `mount` in its tenant's cache (which outlives jobs),
and the next job names that cache first in its PATH (or a library of its own in LD_PRELOAD). The
sandbox's first steps (the namespaces' init shell, unshare, setpriv) ran as root with the job's
environment, so root ran the tenant's `mount`. Now those steps get a fixed environment and the
job's variables only after setpriv: whatever the job names runs as the tenant, never as root.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import publish_image, wait_for
from job_node import job_node
from test_cross_tenant_process import Node, _submit

from computepool.agent.tenants import remove_tenant_user

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent")]

PLANT = r"""
import os, stat
cache = os.environ["CPOOL_CACHE_DIR"]
for name in ("mount", "unshare", "setpriv", "sh"):
    path = os.path.join(cache, name)
    with open(path, "w") as f:
        f.write("#!/bin/sh\nid -u > %s/ran-%s-$$\nexec /usr/bin/%s \"$@\"\n" % (cache, name, name))
    os.chmod(path, 0o755)
print(cache, flush=True)
"""
LOOK = "import os; c = os.environ['CPOOL_CACHE_DIR']; print(sorted(os.listdir(c)), flush=True)"


@pytest.fixture
def node() -> Iterator[Node]:
    root = Path("/var/tmp") / f"cpool-env-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o755)
    n = Node(root)
    try:
        n.start()
        yield n
    finally:
        n.close()
        shutil.rmtree(root, ignore_errors=True)


def _ended(node: Node, client: httpx.Client, alloc_id: int) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        a = dict(client.get(f"/api/v1/allocations/{alloc_id}").json())
        return a if a["state"] in ("released", "failed", "cancelled") else None

    return dict(wait_for(f"allocation {alloc_id} to end", done, 90, node.logs))


def _stdout(client: httpx.Client, alloc_id: int) -> str:
    def read() -> str:
        return str(client.get(f"/api/v1/allocations/{alloc_id}/logs").json()["stdout"]["data"])

    return str(wait_for("the job's output", read, 30))


def test_a_jobs_path_and_loader_variables_never_reach_a_root_step(node: Node) -> None:
    tenant = f"ev{uuid.uuid4().hex[:6]}"
    try:
        client = node.member(tenant)
        plant = _submit(client, ["python3", "-c", PLANT])
        assert _ended(node, client, plant)["state"] == "released"
        cache = _stdout(client, plant).split()[0]
        env = {
            "PATH": f"{cache}:/usr/local/bin:/usr/bin:/bin",
            "LD_PRELOAD": f"{cache}/no-such-library.so",
            "GLIBC_TUNABLES": "glibc.malloc.check=3",
            "ENV": f"{cache}/mount",
            "BASH_ENV": f"{cache}/mount",
        }
        job = _submit(client, ["python3", "-c", LOOK], env=env)
        out = _ended(node, client, job)
        assert out["state"] == "released", out
        ran = {p.name: p.read_text().strip() for p in Path(cache).glob("ran-*")}
        assert "0" not in ran.values(), f"root ran the tenant's programs: {ran}\n{node.logs()[-3000:]}"
        # the job still got its own variables: python3 was found, and its environment is the job's
        check = _submit(client, ["python3", "-c", "import os; print(os.environ['GLIBC_TUNABLES'])"], env=env)
        assert _ended(node, client, check)["state"] == "released"
        assert _stdout(client, check).strip() == "glibc.malloc.check=3"
    finally:
        remove_tenant_user(tenant)


def test_a_container_jobs_loader_variables_never_reach_root(image: str) -> None:
    """The same against a container job: its wrapper and podman ran as root with the job's variables
    (podman's `env -i` came after them), so root loaded a library the tenant left in its cache
    (LD_PRELOAD) and wrote the loader's debug output where the tenant said (LD_DEBUG_OUTPUT). Now
    they run with a fixed environment; the job's variables reach the container through its env file."""
    with job_node() as n:
        tenant, client = n.member("ec")
        publish_image(n.admin, image, [tenant])
        plant = n.submit(client, ["python3", "-c", "import os; print(os.environ['CPOOL_CACHE_DIR'])"])
        assert n.ended(client, plant)["state"] == "released"
        cache = Path(_stdout(client, plant).split()[0])
        env = {
            "LD_DEBUG": "files",
            "LD_DEBUG_OUTPUT": f"{cache}/ld",
            "LD_PRELOAD": f"{cache}/no-such-library.so",
            "GLIBC_TUNABLES": "glibc.malloc.check=3",
        }
        show = "import os; print(os.environ['GLIBC_TUNABLES'])"
        job = n.submit(client, ["python3", "-c", show], env=env, image=image)
        out = n.ended(client, job)
        assert out["state"] == "released", out
        by_root = [p.name for p in cache.iterdir() if p.stat().st_uid == 0]
        assert by_root == [], f"root's steps ran with the job's loader variables: {by_root}"
        assert _stdout(client, job).strip() == "glibc.malloc.check=3"  # the container still has them
