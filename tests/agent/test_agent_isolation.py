"""Slice environments per tier, the PyTorch shim, MPS helpers and the GPU memory watchdog."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from computepool.agent.devices import SIM_MEMORY_FILE_ENV, DeviceInfo, SimulatedBackend
from computepool.agent.executor import Executor, JobSpec
from computepool.agent.isolation import (
    FRACTION_ENV,
    IsolationUnavailable,
    MemoryWatchdog,
    MpsDaemon,
    SliceAssignment,
    memory_fraction,
    resolve_slices,
    slice_env,
    write_shim,
)
from computepool.agent.localstate import JobState
from computepool.core import InvalidInput, Isolation, Slice

GPU = DeviceInfo(0, "nvidia", "A100", 81920, "GPU-aaaa", physical_index=0)
GPU1 = DeviceInfo(1, "nvidia", "A100", 81920, "GPU-bbbb", physical_index=1)
MIG = DeviceInfo(2, "nvidia", "A100-MIG-3g.40gb", 40192, "MIG-cccc", 2, 429, mig_parent_uuid="GPU-dddd")


def _one(
    device: DeviceInfo, tier: Isolation, milli: int = 1000, mib: int | None = None
) -> list[SliceAssignment]:
    return [SliceAssignment(device, milli, device.memory_mib if mib is None else mib, tier)]


def test_exclusive_env_names_the_devices_alone(tmp_path: Path) -> None:
    slices = _one(GPU, Isolation.EXCLUSIVE) + _one(GPU1, Isolation.EXCLUSIVE)
    env = slice_env("alloc-1", 2, slices, tmp_path, user_env={"CUDA_VISIBLE_DEVICES": "0,1,2", "MY": "x"})
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa,GPU-bbbb"  # the user cannot widen it
    assert env["MY"] == "x"
    assert (env["CPOOL_ALLOCATION_ID"], env["CPOOL_ATTEMPT"], env["CPOOL_ISOLATION"]) == (
        "alloc-1",
        "2",
        "exclusive",
    )
    assert env["CPOOL_GPU_MEMORY_MIB"] == "81920,81920"
    assert env["CPOOL_GPU_COMPUTE_MILLI"] == "1000,1000"
    assert FRACTION_ENV not in env and "PYTHONPATH" not in env
    assert env["CUDA_MPS_PIPE_DIRECTORY"].startswith(str(tmp_path))  # never a stray MPS daemon


def test_mig_env_uses_the_instance_uuid(tmp_path: Path) -> None:
    env = slice_env("a", 1, _one(MIG, Isolation.MIG, 429), tmp_path)
    assert env["CUDA_VISIBLE_DEVICES"] == "MIG-cccc" and env["CPOOL_ISOLATION"] == "mig"
    with pytest.raises(IsolationUnavailable, match="not a MIG instance"):
        slice_env("a", 1, _one(GPU, Isolation.MIG), tmp_path)


def test_cpu_only_job_sees_no_gpu(tmp_path: Path) -> None:
    env = slice_env("cpu", 1, [], tmp_path)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["CPOOL_ISOLATION"] == "none"


def test_mps_env_carries_thread_percentage_and_pinned_memory(tmp_path: Path) -> None:
    daemon = MpsDaemon("GPU-aaaa", tmp_path / "mps")
    daemon.pipe_dir.mkdir(parents=True)
    (daemon.pipe_dir / "nvidia-cuda-mps-control.pid").write_text(str(os.getpid()))  # a live pid
    assert daemon.running()
    env = slice_env("m", 1, _one(GPU, Isolation.MPS, 300, 8192), tmp_path, mps={"GPU-aaaa": daemon})
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(daemon.pipe_dir)
    assert env["CUDA_MPS_LOG_DIRECTORY"] == str(daemon.log_dir)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa"
    with pytest.raises(IsolationUnavailable, match="MPS unavailable"):
        slice_env("m", 1, _one(GPU1, Isolation.MPS, 300, 8192), tmp_path, mps={"GPU-aaaa": daemon})
    with pytest.raises(InvalidInput, match="one device"):
        slice_env("m", 1, _one(GPU, Isolation.MPS) + _one(GPU1, Isolation.MPS), tmp_path, mps={})


def test_mps_daemon_without_binary_says_why(tmp_path: Path) -> None:
    daemon = MpsDaemon("GPU-aaaa", tmp_path, binary="nvidia-cuda-mps-control-missing")
    ok, why = daemon.available()
    assert not ok and why.startswith("MPS unavailable:")
    with pytest.raises(IsolationUnavailable, match="MPS unavailable"):
        daemon.start()
    daemon.stop()  # nothing running: a no-op


@pytest.mark.skipif(os.geteuid() != 0, reason="a root agent's check: tenants' users are other uids")
def test_mps_pipes_a_tenant_cannot_reach_are_refused_with_the_directory() -> None:
    """The MPS server runs as the client's uid: under a 0700 dir (an agent's data dir) every client
    failed with CUDA error 805 on a real H200; the daemon now refuses to start there and says why."""
    top = Path(tempfile.mkdtemp(prefix="cpool-mps-", dir="/tmp"))  # pytest's tmp_path sits under 0700
    try:
        os.chmod(top, 0o711)
        closed = top / "agent"
        closed.mkdir(mode=0o700)
        daemon = MpsDaemon("GPU-aaaa", closed / "mps", binary="/bin/true")
        ok, why = daemon.available()
        assert not ok and str(closed) in why and "0700" in why and "--mps-dir" in why
        with pytest.raises(IsolationUnavailable, match="cannot pass"):
            daemon.start()
        os.chmod(closed, 0o711)
        assert MpsDaemon("GPU-aaaa", closed / "mps", binary="/bin/true").available() == (True, "")
    finally:
        shutil.rmtree(top)


def test_timeslice_env_writes_the_shim_and_the_fraction(tmp_path: Path) -> None:
    env = slice_env(
        "t", 1, _one(GPU, Isolation.TIMESLICE, 250, 20480), tmp_path, user_env={"PYTHONPATH": "/mine"}
    )
    shim_dir = tmp_path / "cpool-shim"
    assert env["PYTHONPATH"] == f"{shim_dir}{os.pathsep}/mine"
    assert (shim_dir / "sitecustomize.py").exists()
    assert float(env[FRACTION_ENV]) == memory_fraction(20480, 81920)
    assert 0.24 < float(env[FRACTION_ENV]) < 0.25  # the slice less the CUDA context reserve
    with pytest.raises(InvalidInput, match="mixes"):
        slice_env("t", 1, _one(GPU, Isolation.TIMESLICE, 250, 1) + _one(GPU1, Isolation.MPS), tmp_path)


def test_the_shim_is_never_written_through_a_link_the_tenant_made(tmp_path: Path) -> None:
    """The job dir is the tenant's: a `cpool-shim` (or its file) made a link elsewhere is refused,
    and nothing is written where it points."""
    from computepool.agent.isolation import write_shim

    elsewhere = tmp_path / "root-owned"
    elsewhere.mkdir()
    job = tmp_path / "work"
    job.mkdir()
    (job / "cpool-shim").symlink_to(elsewhere)
    with pytest.raises(OSError):
        write_shim(job)
    (job / "cpool-shim").unlink()
    (job / "cpool-shim").mkdir()
    (job / "cpool-shim" / "sitecustomize.py").symlink_to(elsewhere / "target.py")
    (job / "cpool-shim" / ".sitecustomize.py.tmp").symlink_to(elsewhere / "tmp.py")
    assert write_shim(job) == job / "cpool-shim"  # the links are replaced, not followed
    assert list(elsewhere.iterdir()) == []
    assert not (job / "cpool-shim" / "sitecustomize.py").is_symlink()


def test_resolve_slices_checks_the_device() -> None:
    got = resolve_slices([Slice("n", 1, 500, 4096, Isolation.TIMESLICE)], [GPU, GPU1])
    assert got == [SliceAssignment(GPU1, 500, 4096, Isolation.TIMESLICE)]
    with pytest.raises(InvalidInput, match=r"slices\[0\].*no device 7"):
        resolve_slices([Slice("n", 7, 500, 1, Isolation.TIMESLICE)], [GPU])
    with pytest.raises(InvalidInput, match="more than device 0 holds"):
        resolve_slices([Slice("n", 0, 500, 90000, Isolation.TIMESLICE)], [GPU])


def _python(env: dict[str, str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)


def test_shim_is_harmless_for_a_program_without_torch(tmp_path: Path) -> None:
    shim = write_shim(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(shim), **{FRACTION_ENV: "0.25"})
    done = _python(env, "import json, sys; print(json.dumps({'ok': True})); sys.exit(0)")
    assert (done.returncode, done.stdout, done.stderr) == (0, '{"ok": true}\n', "")
    # a garbled fraction is ignored, not fatal
    done = _python(dict(env, **{FRACTION_ENV: "lots"}), "print('fine')")
    assert (done.returncode, done.stdout, done.stderr) == (0, "fine\n", "")


def test_shim_still_runs_the_sitecustomize_it_shadows(tmp_path: Path) -> None:
    shim = write_shim(tmp_path / "job")
    other = tmp_path / "site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITE'] = 'ran'\n")
    env = dict(os.environ, PYTHONPATH=f"{shim}{os.pathsep}{other}", **{FRACTION_ENV: "0.5"})
    done = _python(env, "import os; print(os.environ.get('OTHER_SITE'))")
    assert done.stdout == "ran\n", done.stderr


def test_shim_caps_torch_when_the_program_imports_it(tmp_path: Path) -> None:
    """A stand-in `torch` records what the shim asks of it (real torch is checked on a GPU)."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("from torch import cuda\n")
    (fake / "cuda.py").write_text(
        "calls = []\n_queued = []\n"
        "def is_available(): return True\n"
        "def device_count(): return 2\n"
        "def set_per_process_memory_fraction(f, i): calls.append((f, i))\n"
        "def _lazy_call(fn): _queued.append(fn)\n"
        "def init():\n    for fn in _queued: fn()\n"
    )
    shim = write_shim(tmp_path / "job")
    env = dict(os.environ, PYTHONPATH=f"{shim}{os.pathsep}{fake.parent}", **{FRACTION_ENV: "0.3,0.6"})
    code = "import torch; print(torch.cuda.calls); torch.cuda.init(); print(torch.cuda.calls)"
    done = _python(env, code)
    assert done.stdout.splitlines() == ["[]", "[(0.3, 0), (0.6, 1)]"], done.stderr


def test_watchdog_stops_a_process_over_its_slice(executor: Executor) -> None:
    backend = SimulatedBackend("1xA100-80GB", seed="wd")
    watchdog = MemoryWatchdog(backend, executor, interval_s=0.05, kill_grace_s=1)
    code = (
        "import os, time\n"
        "f = os.environ['CPOOL_SIM_MEMORY_FILE']\n"
        "open(f, 'w').write('4000')\n"
        "time.sleep(0.3)\n"
        "open(f, 'w').write('12000')\n"
        "time.sleep(60)\n"
    )
    # the agent's part: point the workload at a memory file in its run dir, and tell the simulated
    # driver which process runs where and where to hear its usage
    mem_file = executor.run_dir("wd", 1) / "sim_gpu_memory_mib"
    rec = executor.start(
        JobSpec("wd", 1, [sys.executable, "-c", code], env={SIM_MEMORY_FILE_ENV: str(mem_file)})
    )
    backend.attach(rec.pid, 0, 8192, 500, memory_file=mem_file)
    uuid = backend.discover()[0].uuid
    watchdog.watch(rec.key, {uuid: 8192})
    watchdog.start()
    try:
        done = executor.wait(rec.key, 20)
    finally:
        watchdog.close()
    assert done.state is JobState.KILLED
    assert done.reason == f"GPU memory 12000 MiB over slice limit 8192 MiB on {uuid}"
    assert [v.used_mib for v in watchdog.violations] == [12000]
    assert watchdog.watched() == []


def test_watchdog_leaves_a_job_within_its_slice_alone(executor: Executor) -> None:
    backend = SimulatedBackend("1xT4-16GB", seed="wd2")
    watchdog = MemoryWatchdog(backend, executor)
    rec = executor.start(JobSpec("calm", 1, ["sleep", "30"]))
    backend.attach(rec.pid, 0, 4096, 500)
    watchdog.watch(rec.key, {backend.discover()[0].uuid: 8192})
    assert watchdog.check_once() == []
    # memory on a device outside the slice is over a limit of 0
    watchdog.watch(rec.key, {"GPU-other": 8192})
    (v,) = watchdog.check_once()
    assert "outside the slice" in v.reason
    assert executor.wait(rec.key, 10).state is JobState.KILLED
