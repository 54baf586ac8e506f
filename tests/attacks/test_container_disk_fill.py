"""Tenant B's container job fills the node's disk through its image's own files, so that the disk
guard stops tenant A's job.

A container job writes where its image lets the tenant's uid: `/work` (its job dir), its tenant's
cache, the sized tmpfs mounts, and any world-writable dir the image has (`/scratch` below; many
images open a dir or two to any uid). The last lands in the container's writable layer in podman's
storage, on the node's disk, and the disk guard counted none of it: on a nearly full disk it
stopped A's process job, whose 4 MiB were the most it could see, and B's went on writing. A
container's writable layer now counts as its job's own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_node import sandbox_node

from computepool.agent.container import Podman
from computepool.agent.disk_guard import DiskGuard, free_space, running_jobs
from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec, SandboxConfig
from computepool.agent.localstate import JobState, job_key
from computepool.agent.tenants import remove_tenant_user

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and rootful podman need root")]
MIB = 1 << 20
SCRATCH_IMAGE = "localhost/cpool-scratch-test:1"


@pytest.fixture
def scratch_image(image: str) -> str:
    """The test image with a world-writable /scratch (podman caches the layer after once)."""
    ctx = Path("/var/tmp") / f"cpool-img-{uuid.uuid4().hex[:8]}"
    ctx.mkdir()
    try:
        (ctx / "Containerfile").write_text(f"FROM {image}\nRUN mkdir -m 1777 /scratch\n")
        engine = Podman(ctx / "engine")
        engine.write_conf()
        build = engine.command(["build", "--pull=never", "--tag", SCRATCH_IMAGE, str(ctx)])
        done = subprocess.run(build, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
    finally:
        shutil.rmtree(ctx, ignore_errors=True)
    return SCRATCH_IMAGE


@pytest.fixture
def node() -> Iterator[Executor]:
    """A sandboxing executor as a root agent has it; its jobs, containers, data and users go at the end."""
    with sandbox_node("cdf", SandboxConfig(), cgroup_base=None, containers=True) as ex:
        yield ex


def _wait_out(run_dir: str, text: str) -> None:
    deadline = time.monotonic() + 90
    while text not in (Path(run_dir) / STDOUT_LOG).read_text():
        assert time.monotonic() < deadline, f"{text!r} never appeared in {run_dir}"
        time.sleep(0.1)


def test_a_container_filling_its_images_files_is_the_one_stopped(node: Executor, scratch_image: str) -> None:
    ex = node
    tenant_a, tenant_b = f"da{uuid.uuid4().hex[:6]}", f"db{uuid.uuid4().hex[:6]}"
    try:
        keep = "open('model.bin', 'wb').write(b'x' * (4 << 20)); print('ready', flush=True)"
        a = ex.start(
            JobSpec("1", 1, ["python3", "-c", f"{keep}; import time; time.sleep(600)"], tenant=tenant_a)
        )
        fill = "open('/scratch/fill', 'wb').write(b'x' * (40 << 20)); print('ready', flush=True)"
        b = ex.start(
            JobSpec(
                "2",
                1,
                ["python3", "-c", f"{fill}; import time; time.sleep(600)"],
                tenant=tenant_b,
                image=scratch_image,
                memory_mib=256,
            )  # fmt: skip
        )
        assert a.state is JobState.RUNNING and b.state is JobState.RUNNING, (a.reason, b.reason)
        _wait_out(a.run_dir, "ready")
        _wait_out(b.run_dir, "ready")
        free, _total = free_space(ex.data_dir)
        stopped: list[tuple[str, str]] = []
        guard = DiskGuard(
            ex.data_dir / "runs", job_key, lambda: {r.key for r in ex.running()}, lambda: running_jobs(ex),
            lambda key, reason: stopped.append((key, reason)),
            min_free_bytes=free + (1 << 30), min_free_share=1.0,  # this disk, as if nearly full
        )  # fmt: skip
        assert guard.check_once() == [f"stopped {job_key('2', 1)}"], stopped
        [(key, reason)] = stopped
        assert key == b.key and "took 40 MiB" in reason, reason
    finally:
        for rec in ex.running():
            ex.kill(rec.key, "teardown", grace_s=0)
        remove_tenant_user(tenant_a)
        remove_tenant_user(tenant_b)
