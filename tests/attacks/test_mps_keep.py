"""A job's code cannot make the node treat it as an MPS client.

An MPS client keeps the host's IPC namespace and its daemon's pipe directory (bound back into its
mount namespace). The node told one from `CUDA_MPS_PIPE_DIRECTORY` naming an existing directory,
and every other job gets `<work>/no-mps` there, meant never to exist: but a job's code is unpacked
into `<work>` first, so code holding a `no-mps/` directory put the job in the host's IPC namespace
(the SysV segments, queues and semaphores of the host and of other tenants' MPS jobs, and what it
left there stayed). Only an mps slice's daemon directory is kept now.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import cpool
from job_node import Node, job_node

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and namespaces need a root agent"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="namespaces need util-linux unshare"),
]


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with job_node() as n:
        yield n


def test_code_holding_no_mps_keeps_the_job_out_of_the_hosts_ipc_namespace(node: Node, tmp_path: Path) -> None:
    tenant, _ = node.member("mk")
    project = tmp_path / "project"
    (project / "no-mps").mkdir(parents=True)
    (project / "no-mps" / "keep.txt").write_text("x")
    r = subprocess.run(
        cpool("run", "--cpus", "0.1", "--", "readlink", "/proc/self/ns/ipc"),
        cwd=project, env=node.cli_env(tenant), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, (r.stderr, node.logs())
    seen = r.stdout.strip().splitlines()[-1]
    assert seen.startswith("ipc:[") and seen != os.readlink("/proc/self/ns/ipc"), r.stdout


def test_a_job_that_is_no_mps_client_sees_no_mps_daemon(node: Node, tmp_path: Path) -> None:
    """Every device's MPS daemon keeps its control pipe under the MPS root, which others may pass:
    a job of any tenant could reach a daemon by its device's uuid and talk to it. A job that is no
    MPS client has the MPS root covered."""
    tenant, _ = node.member("mv")
    daemon = Path("/run/computepool/mps") / f"GPU-test-{os.getpid()}-{tmp_path.name}"[:60]
    pipe = daemon / "pipe"
    pipe.mkdir(parents=True)
    for d in (daemon.parent.parent, daemon.parent, daemon):
        os.chmod(d, 0o711)
    os.chmod(pipe, 0o755)
    (pipe / "control").write_text("")
    try:
        r = subprocess.run(
            cpool("run", "--no-code", "--cpus", "0.1", "--", "ls", str(pipe)),
            env=node.cli_env(tenant), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode != 0 and "control" not in r.stdout, (r.stdout, r.stderr)
        assert "No such file" in r.stderr, r.stderr
    finally:
        shutil.rmtree(daemon, ignore_errors=True)
