"""A process job opens the device files of accelerators its slice does not hold.

The drivers leave their device files open to every user (`/dev/nvidia1` is 0666 by default, a DRM
render node too): a job of tenant B, CPU-only or on a slice of one GPU, could open tenant A's GPU
and fill its memory or run on it beside A's exclusive job. The node here is a tree of real character
devices (each the null device's numbers, 0666, in a directory of the test's own) laid out as the
drivers name them; the agent's sandbox is told to read the node's device files there.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.devfiles import hidden_files
from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec, SandboxConfig
from computepool.agent.localstate import JobState
from computepool.agent.tenants import remove_tenant_user

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="tenant users, device files and namespaces need root"
)

PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
RANGE = (61000, 61999)
FILES = ("nvidia0", "nvidia1", "nvidiactl", "kfd", "dri/renderD128", "dri/renderD129", "davinci0")
PROBE = (
    "import json, sys\n"
    "out = {}\n"
    "for p in sys.argv[1:]:\n"
    "    try:\n"
    "        open(p, 'r+b').close(); out[p] = 'opened'\n"
    "    except OSError as e:\n"
    "        out[p] = e.strerror\n"
    "print(json.dumps(out))\n"
)


@pytest.fixture(scope="module")
def dev() -> Iterator[Path]:
    """A device tree outside /tmp and /var/tmp (a job has its own of those), passable by every user."""
    root = Path("/var/lib") / f"cpool-dev-{uuid.uuid4().hex[:8]}"
    (root / "dri").mkdir(parents=True, mode=0o755)
    os.chmod(root, 0o755)
    null = os.stat("/dev/null").st_rdev
    for name in FILES:
        os.mknod(root / name, 0o666 | stat.S_IFCHR, null)
        os.chmod(root / name, 0o666)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def executor(dev: Path) -> Iterator[tuple[Executor, str]]:
    """An executor of a root agent whose node's device files are `dev`, and a tenant of its own."""
    data = Path("/var/tmp") / f"cpool-devfiles-{uuid.uuid4().hex[:8]}"
    data.mkdir(mode=0o755)
    ex = Executor(
        data / "agent", cgroup_base=None, kill_grace_s=1.0, sandbox=SandboxConfig(uid_range=RANGE, dev=dev)
    )
    tenant = f"t{uuid.uuid4().hex[:8]}"
    yield ex, tenant
    ex.state.close()
    remove_tenant_user(tenant, RANGE)
    shutil.rmtree(data, ignore_errors=True)


def _opens(
    node: tuple[Executor, str], dev: Path, name: str, uuids: tuple[str, ...], nodes: tuple[str, ...]
) -> dict[str, str]:
    """What a job of the tenant on a slice of `uuids` (with device files `nodes`) could open."""
    ex, tenant = node
    paths = [str(dev / f) for f in FILES]
    spec = JobSpec(name, 1, [PY, "-c", PROBE, *paths], tenant=tenant, device_uuids=uuids, device_nodes=nodes)
    done = ex.wait(ex.start(spec).key, 20)
    assert done.state is JobState.SUCCEEDED, (done.reason, (Path(done.run_dir) / "stderr.log").read_text())
    seen = json.loads((Path(done.run_dir) / STDOUT_LOG).read_text())
    return {Path(p).relative_to(dev).as_posix(): r for p, r in seen.items()}


def test_a_cpu_job_opens_no_accelerator_file(executor: tuple[Executor, str], dev: Path) -> None:
    seen = _opens(executor, dev, f"cpu{uuid.uuid4().hex[:6]}", (), ())
    assert seen == dict.fromkeys(FILES, "Permission denied")
    assert all(stat.S_IMODE((dev / f).stat().st_mode) == 0o666 for f in FILES)  # the host's left as they were


def test_a_job_on_one_gpu_opens_its_own_files_and_none_of_the_others(
    executor: tuple[Executor, str], dev: Path
) -> None:
    mine = (str(dev / "kfd"), str(dev / "dri/renderD128"))  # what an AMD backend finds for its GPU
    seen = _opens(executor, dev, f"gpu{uuid.uuid4().hex[:6]}", ("amd-sim-x",), mine)
    assert seen == {
        "kfd": "opened", "dri/renderD128": "opened", "nvidiactl": "opened",  # shared entry points stay
        "nvidia0": "Permission denied", "nvidia1": "Permission denied",
        "dri/renderD129": "Permission denied", "davinci0": "Permission denied",
    }  # fmt: skip


def test_the_files_of_an_nvidia_gpu_that_cannot_be_told_stay_open_and_the_job_says_so(
    dev: Path, tmp_path: Path
) -> None:
    hide, why = hidden_files(("GPU-0000-unknown",), (), dev)
    assert hide == [str(dev / f) for f in ("davinci0", "dri/renderD128", "dri/renderD129")]
    assert why == "the NVIDIA device files stay open: none found for GPU-0000-unknown"
    # a simulated GPU on a node without NVIDIA's files: nothing is left open, nothing to say
    (tmp_path / "dri").mkdir()
    os.mknod(tmp_path / "dri" / "renderD128", 0o666 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
    assert hidden_files(("GPU-0000-simulated",), (), tmp_path) == ([str(tmp_path / "dri" / "renderD128")], "")
