"""The SDK's `.result()` waits out a control plane that restarts under it, and returns the value; so
does `.remote()` whose submission was waiting for the outcome when the control plane went."""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import child_env, cpool, job_readable_dir, wait_for
from test_sdk_e2e import Cluster, pytestmark  # noqa: F401 - the same machine needs

from computepool.sdk import Pool


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    root = Path("/var/tmp") / f"cpool-sdkr-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
    c = Cluster(root)
    try:
        c.start()
        yield c
    finally:
        c.close()
        shutil.rmtree(root, ignore_errors=True)


def test_result_rides_out_a_control_plane_restart(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = job_readable_dir() / f"cpool-sdkr-gate-{uuid.uuid4().hex[:8]}"  # the worker can read it
    monkeypatch.chdir(tmp_path)
    with Pool(server=cluster.url, token=cluster.token) as pool:

        @pool.function(cpus=0.1, name="gated")
        def gated(path: str) -> str:
            import os
            import time

            print("waiting", flush=True)
            while not os.path.exists(path):
                time.sleep(0.2)
            return "through the restart"

        h = gated.spawn(str(gate))
        wait_for("the call running", lambda: gated.poll([h], 1) or h.state == "running", 120, cluster.logs)
        got: dict[str, Any] = {}
        waiter = threading.Thread(target=lambda: got.update(value=_result(h)), daemon=True)
        waiter.start()
        # a second call by `.remote()`: its submission waits for the outcome as the server goes;
        # sent again after the restart, its key answers the same call
        remote = threading.Thread(target=lambda: got.update(remote=_remote(gated, str(gate))), daemon=True)
        remote.start()
        fid = gated.register()
        wait_for(
            "the second call stored",
            lambda: pool.client.request("GET", f"/functions/{fid}")["workers_live"] == 2,
            60,
            cluster.logs,
        )

        server = cluster.procs[0]
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
        port = cluster.url.rsplit(":", 1)[1]
        with (cluster.root / "server.log").open("ab") as out:
            cluster.procs[0] = subprocess.Popen(
                cpool("server", "--data-dir", str(cluster.srv_dir), "--port", port),
                stdout=out, stderr=subprocess.STDOUT, env=child_env(),
            )  # fmt: skip
        wait_for("the server again", lambda: httpx.get(f"{cluster.url}/readyz").is_success, 60, cluster.logs)
        gate.touch()
        try:
            waiter.join(timeout=180)
            remote.join(timeout=180)
            assert not waiter.is_alive() and not remote.is_alive(), cluster.logs()
            assert got == {"value": "through the restart", "remote": "through the restart"}, (
                got,
                cluster.logs(),
            )
        finally:
            gate.unlink(missing_ok=True)


def _result(h: Any) -> Any:
    try:
        return h.result(timeout=300)
    except Exception as e:  # noqa: BLE001 - the test shows what ended the wait
        return e


def _remote(fn: Any, path: str) -> Any:
    try:
        return fn.remote(path)
    except Exception as e:  # noqa: BLE001 - the test shows what ended the call
        return e
