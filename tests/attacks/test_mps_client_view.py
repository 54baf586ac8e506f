"""An MPS client job and the other devices' MPS daemons.

Every device's MPS daemon keeps its control pipe under the agent's MPS root, which tenants' users
may pass (an MPS server runs as its client's user and must reach its pipes). A job that is no MPS
client has the root covered (`test_mps_keep.py`), but an MPS client of one device kept the whole
root in view: it reached another device's daemon by that device's uuid, and a control daemon
starts a server as whoever asks, so B's job, a client of device 0, could start one of its own on
device 1, where only one user's server runs at a time: A's clients there waited behind it. The
root is covered for a client too, and its own daemon's pipes bound back.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent import sandbox

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and another user need root")
NOBODY = "nobody"  # a user with no rights of its own, standing for the tenant's


@pytest.fixture
def mps_root() -> Iterator[Path]:
    """An MPS root as the agent lays it out: a dir per device's daemon, passable by everyone."""
    root = Path("/run/computepool") / f"mps-test-{uuid.uuid4().hex[:8]}"
    for dev in ("GPU-aaaa", "GPU-bbbb"):
        (root / dev / "pipe").mkdir(parents=True)
        (root / dev / "pipe" / "control").write_text("")
    for d in [root, *root.iterdir(), *root.glob("*/pipe")]:
        os.chmod(d, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_an_mps_client_reaches_its_own_daemon_alone(mps_root: Path, tmp_path: Path) -> None:
    user = pwd.getpwnam(NOBODY)
    work = tmp_path / "work"
    work.mkdir()
    os.chown(work, user.pw_uid, user.pw_gid)
    host = sandbox.probe(sandbox.SandboxConfig())
    if not host.namespaces:
        pytest.skip(f"no namespaces here: {host.why_not}")
    own, other = mps_root / "GPU-aaaa" / "pipe", mps_root / "GPU-bbbb" / "pipe"
    look = f"ls {own}; echo --; ls {other} 2>&1; echo --; ls {mps_root}"
    argv, _ = sandbox.wrap(["/bin/sh", "-c", look], user, work, host, keep=own, mps_root=mps_root)
    done = subprocess.run(
        argv, env=sandbox.root_side_env({}), capture_output=True, text=True, timeout=60, cwd=work, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    mine, others, listed = (part.split() for part in done.stdout.split("--\n"))
    assert mine == ["control"], done.stdout  # its own daemon's pipe: it stays an MPS client
    assert "control" not in others and listed == ["GPU-aaaa"], done.stdout  # (it listed GPU-bbbb)
