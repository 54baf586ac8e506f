"""The fence reaches container jobs: a stubborn workload in a real podman container (started by the
real executor) is stopped and its container removed once the node is out of contact, with no agent."""

from __future__ import annotations

import json
import time
from pathlib import Path

from computepool.agent import fencing
from computepool.agent.container import Podman
from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec

IMAGE = "localhost/pybase:1"


def test_a_fenced_container_job_is_stopped_and_its_container_removed(
    container_executor: tuple[Executor, str],
) -> None:
    ex, tenant = container_executor
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
