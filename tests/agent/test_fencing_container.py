"""The fence reaches container jobs: a stubborn workload in a real podman container (started by the
real executor) is stopped and its container removed once the node is out of contact, with no agent."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent import fencing
from computepool.agent.container import Podman
from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec, SandboxConfig
from computepool.agent.tenants import remove_tenant_user

IMAGE = "localhost/pybase:1"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def image() -> str:
    if os.geteuid() != 0 or shutil.which("podman") is None:
        pytest.skip("container jobs need root and podman")
    if subprocess.run(["podman", "image", "exists", IMAGE], check=False).returncode != 0:
        built = subprocess.run([str(ROOT / "scripts" / "build-test-image.sh"), IMAGE],
                               capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
        if built.returncode != 0:
            pytest.skip(f"test image {IMAGE} unavailable: {built.stderr.strip()[-300:]}")
    return IMAGE


@pytest.fixture
def setup(image: str) -> Iterator[tuple[Executor, str]]:
    data = Path("/var/tmp") / f"cpool-fence-{uuid.uuid4().hex[:8]}"
    data.mkdir()
    tenant = f"t{uuid.uuid4().hex[:8]}"
    ex = Executor(data / "agent", cgroup_base=None, kill_grace_s=2.0, sandbox=SandboxConfig())
    yield ex, tenant
    for rec in ex.running():
        ex.kill(rec.key, "teardown", grace_s=0)
    engine = Podman(data / "agent")
    for key in engine.all_keys():
        engine.remove(key)
    ex.state.close()
    shutil.rmtree(data, ignore_errors=True)
    remove_tenant_user(tenant)


def test_a_fenced_container_job_is_stopped_and_its_container_removed(setup: tuple[Executor, str]) -> None:
    ex, tenant = setup
    code = (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\ntime.sleep(300)\n"
    )
    rec = ex.start(JobSpec("f1", 1, ["python3", "-c", code], tenant=tenant, image=IMAGE))
    deadline = time.monotonic() + 90
    while "ready" not in (Path(rec.run_dir) / STDOUT_LOG).read_text():
        assert time.monotonic() < deadline, "the container job never started"
        time.sleep(0.1)
    engine = Podman(ex.data_dir)
    assert engine.running_keys() == {rec.key}
    target = fencing.target_of(rec, ex.launcher.container_engine)
    assert target.container == engine.name(rec.key) and target.podman_conf
    contact = {"contact": fencing.now_s(), "deadline": fencing.now_s() + 1.0, "fence_s": 1.0}
    (ex.data_dir / fencing.CONTACT_FILE).write_text(json.dumps(contact))
    sup = fencing.spawn(ex.data_dir, target, grace_s=1.0)
    assert sup.wait(timeout=90) == 0
    assert fencing.fenced_reason(ex.data_dir, rec.key) is not None
    assert engine.all_keys() == set(), "the fenced container is still there"
    done = ex.wait(rec.key, 30)
    assert done.state.ended
