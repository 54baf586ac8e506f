"""cgroup limits: the file writes for v2 and v1 on fake trees, and the real hierarchy of this host."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from computepool.agent import cgroups
from computepool.agent.cgroups import CgroupV1, CgroupV2
from computepool.agent.executor import Executor, JobSpec, SandboxConfig
from computepool.agent.localstate import JobState
from computepool.agent.tenants import remove_tenant_user

PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"


def test_v2_writes_cpu_memory_and_pids(tmp_path: Path) -> None:
    root = tmp_path / "cg2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    cg = cgroups.detect(root / "computepool")
    assert isinstance(cg, CgroupV2) and cg.usable() == (True, "")
    assert set((root / "cgroup.subtree_control").read_text().split()) == {"+cpu", "+memory", "+pids"}
    job = cg.create("a.1", cpu_milli=1500, memory_mib=256, pids_max=100)
    assert job.path == root / "computepool" / "a.1" and job.paths == (job.path,)
    assert (job.path / "cpu.max").read_text() == "150000 100000"
    assert job.cpu_limit is None
    later = cg.create("b.1", cpu_milli=100, memory_mib=0, defer_cpu=True)  # the sandbox's init writes it
    assert later.cpu_limit == (later.path / "cpu.max", "10000 100000")
    assert not (later.path / "cpu.max").exists()
    assert (job.path / "memory.max").read_text() == str(256 * 1024 * 1024)
    assert (job.path / "pids.max").read_text() == "100"
    (job.path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert cgroups.oom_kills(job.path) == 1


def test_one_agents_jobs_together_hold_at_most_their_share_of_the_hosts_pids(tmp_path: Path) -> None:
    """The agent's own cgroup caps its jobs together below pid_max; a job never gets more alone."""
    pid_max = tmp_path / "pid_max"
    pid_max.write_text("32768\n")
    assert cgroups.jobs_pids_budget(pid_max) == 24576
    root = tmp_path / "cg2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    v2 = CgroupV2(root / "computepool" / "node-a", pids_budget=300)
    assert v2.usable() == (True, "")
    assert (root / "computepool" / "node-a" / "pids.max").read_text() == "300"
    assert (v2.create("a.1", 0, 0, pids_max=100).path / "pids.max").read_text() == "100"
    assert (v2.create("b.1", 0, 0, pids_max=5000).path / "pids.max").read_text() == "300"
    v1_root = tmp_path / "cg1"
    for c in ("cpu", "memory", "pids"):
        (v1_root / c).mkdir(parents=True)
        (v1_root / c / "cgroup.procs").write_text("")
    v1 = CgroupV1(v1_root, "computepool/node-a", pids_budget=200)
    assert v1.usable() == (True, "")
    assert (v1_root / "pids" / "computepool" / "node-a" / "pids.max").read_text() == "200"
    job = v1.create("a.1", 0, 0, pids_max=1000)
    assert (v1_root / "pids" / "computepool" / "node-a" / "a.1" / "pids.max").read_text() == "200"
    assert job.path.parent == v1_root / "memory" / "computepool" / "node-a"


def test_v2_without_controllers_says_why(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("io\n")
    ok, why = cgroups.detect(tmp_path / "computepool").usable()
    assert not ok and "['cpu', 'memory'] not available" in why


def test_v1_writes_each_controller(tmp_path: Path) -> None:
    for c in ("cpu", "memory", "pids"):
        (tmp_path / c).mkdir()
        (tmp_path / c / "cgroup.procs").write_text("")
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")
    cg = cgroups.detect(tmp_path / "computepool")
    assert isinstance(cg, CgroupV1) and cg.usable() == (True, "")
    job = cg.create("a.1", cpu_milli=500, memory_mib=64, pids_max=50)
    assert job.path == tmp_path / "memory" / "computepool" / "a.1"
    assert [p.parent.parent.name for p in job.paths] == ["memory", "cpu", "pids"]
    cpu = tmp_path / "cpu" / "computepool" / "a.1"
    assert (cpu / "cpu.cfs_quota_us").read_text() == "50000"
    later = cg.create("b.1", cpu_milli=100, memory_mib=0, defer_cpu=True)
    assert later.cpu_limit == (tmp_path / "cpu" / "computepool" / "b.1" / "cpu.cfs_quota_us", "10000")
    assert not later.cpu_limit[0].exists()
    assert (cpu / "cpu.cfs_period_us").read_text() == "100000"
    assert (job.path / "memory.limit_in_bytes").read_text() == str(64 * 1024 * 1024)
    assert (tmp_path / "pids" / "computepool" / "a.1" / "pids.max").read_text() == "50"
    (job.path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert cgroups.oom_kills(job.path) == 2


REAL_V1 = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists() and os.geteuid() == 0


@pytest.fixture
def real_cg_executor() -> Iterator[Executor]:
    if not REAL_V1:
        pytest.skip("needs root and a cgroup v1 memory controller at /sys/fs/cgroup/memory")
    base = Path(f"/sys/fs/cgroup/computepool-test-{uuid.uuid4().hex[:8]}")
    data = Path("/var/tmp") / f"cpool-cg-{uuid.uuid4().hex[:8]}"
    data.mkdir()
    tenant = f"t{uuid.uuid4().hex[:8]}"
    ex = Executor(data / "agent", cgroup_base=base, kill_grace_s=1, sandbox=SandboxConfig())
    ex.tenant = tenant  # type: ignore[attr-defined]
    yield ex
    for rec in ex.running():
        ex.kill(rec.key, "teardown", grace_s=0)
    ex.state.close()
    assert ex.cgroup_dir is not None and ex.cgroup_dir.parent == base  # the agent's own, below the base
    for c in ("memory", "cpu", "pids"):
        top = Path("/sys/fs/cgroup") / c / base.name
        cgroups.remove([top / ex.cgroup_dir.name, top])
    shutil.rmtree(data, ignore_errors=True)
    remove_tenant_user(tenant)


def test_real_v1_memory_limit_kills_a_hog_and_says_so(real_cg_executor: Executor) -> None:
    ex = real_cg_executor
    tenant = ex.tenant  # type: ignore[attr-defined]
    hog = [PY, "-c", "b = bytearray(400 * 1024 * 1024); print(len(b))"]
    rec = ex.start(JobSpec("hog", 1, hog, memory_mib=128, tenant=tenant))
    assert rec.limits.startswith("cgroup v1 /sys/fs/cgroup/memory/"), rec.limits
    assert ex.cgroup_dir is not None  # the agent's jobs together: capped on the real hierarchy
    own = Path("/sys/fs/cgroup/pids") / ex.cgroup_dir.relative_to("/sys/fs/cgroup")
    assert own.joinpath("pids.max").read_text().strip() == str(cgroups.jobs_pids_budget())
    assert Path(rec.cgroup, "memory.limit_in_bytes").read_text().strip() == str(128 * 1024 * 1024)
    done = ex.wait(rec.key, 30)
    assert done.state is JobState.FAILED
    assert done.reason == "out of memory (cgroup memory limit 128 MiB)"
    assert not Path(rec.cgroup).exists()  # removed with the job
    small = ex.start(JobSpec("small", 1, [PY, "-c", "b = bytearray(20 * 1024 * 1024)"], memory_mib=128,
                             tenant=tenant))  # fmt: skip
    assert ex.wait(small.key, 30).state is JobState.SUCCEEDED


def test_real_v1_cpu_quota_holds_a_busy_job(real_cg_executor: Executor) -> None:
    """The sandbox's init writes the quota as its last root step (the launcher before it runs
    unthrottled): it is in place once the command runs, and holds it."""
    ex = real_cg_executor
    tenant = ex.tenant  # type: ignore[attr-defined]
    spin = [PY, "-c", "print('go', flush=True)\nwhile True: pass"]
    rec = ex.start(JobSpec("spin", 1, spin, cpu_milli=200, tenant=tenant))
    assert "cpu 200m" in rec.limits
    out = Path(rec.run_dir, "stdout.log")
    deadline = time.monotonic() + 60
    while not out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.read_text() == "go\n", Path(rec.run_dir, "stderr.log").read_text()
    cpu = next(Path(p) for p in rec.extra["cgroup_paths"].splitlines() if "/cpu" in p)
    assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "20000"
    procs = [psutil.Process(p) for p in ex.job_pids(rec.key)]
    t0 = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
    time.sleep(3.0)
    used = sum(p.cpu_times().user + p.cpu_times().system for p in procs) - t0
    assert used / 3.0 < 0.35, f"used {used / 3.0:.2f} CPU with a 0.2 CPU quota"
    assert used / 3.0 > 0.05  # it does run
    ex.kill(rec.key, "done", grace_s=0)


def test_v2_base_below_a_missing_level_enables_each_level(tmp_path: Path) -> None:
    root = tmp_path / "cg2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    cg = cgroups.detect(root / "computepool" / "gpu1-0123abcd")
    assert isinstance(cg, CgroupV2) and cg.usable() == (True, "")
    for level in (root, root / "computepool", root / "computepool" / "gpu1-0123abcd"):
        assert set((level / "cgroup.subtree_control").read_text().split()) == {"+cpu", "+memory", "+pids"}
    assert cg.create("1.1", 500, 64).path == root / "computepool" / "gpu1-0123abcd" / "1.1"


def test_v1_base_below_a_missing_level(tmp_path: Path) -> None:
    for c in ("cpu", "memory"):
        (tmp_path / c).mkdir()
        (tmp_path / c / "cgroup.procs").write_text("")
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")
    cg = cgroups.detect(tmp_path / "computepool" / "gpu1-0123abcd")
    assert isinstance(cg, CgroupV1) and cg.usable() == (True, "")
    job = cg.create("1.1", cpu_milli=500, memory_mib=64)
    assert job.paths == tuple(
        tmp_path / c / "computepool" / "gpu1-0123abcd" / "1.1" for c in ("memory", "cpu")
    )


def test_two_executors_on_one_base_keep_their_jobs_apart_and_sweep_only_their_own(tmp_path: Path) -> None:
    root = tmp_path / "cg2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")
    base = root / "computepool"
    mine = Executor(tmp_path / "a" / "agent", cgroup_base=base, node="gpu1")
    theirs = Executor(tmp_path / "b" / "agent", cgroup_base=base, node="gpu1")  # same name, other pool
    assert mine.cgroup_dir is not None and theirs.cgroup_dir is not None
    assert mine.cgroup_dir != theirs.cgroup_dir and mine.cgroup_dir.parent == theirs.cgroup_dir.parent == base
    assert mine.cgroup_dir.name.startswith("gpu1-") and len(mine.cgroup_dir.name) == len("gpu1-") + 8
    for ex in (mine, theirs):
        assert ex.cgroups is not None and ex.cgroups.usable() == (True, "")
        (ex.cgroup_dir / "1.1").mkdir()  # allocation 1 in both pools
    (mine.cgroup_dir / "not-a-job").mkdir()
    assert mine.adopt().adopted == []  # a fresh start sweeps the empty job cgroups a crash left
    assert not (mine.cgroup_dir / "1.1").exists() and (mine.cgroup_dir / "not-a-job").is_dir()
    assert (theirs.cgroup_dir / "1.1").is_dir()
    for ex in (mine, theirs):
        ex.state.close()


def test_a_root_agent_without_usable_cgroups_is_warned_and_one_with_them_is_not(tmp_path: Path) -> None:
    assert "cgroups disabled" in cgroups.unheld_warning(None, root=True)
    assert cgroups.unheld_warning(None, root=False) == ""  # a non-root agent says why it is weaker itself
    (tmp_path / "cgroup.controllers").write_text("io\n")
    line = cgroups.unheld_warning(tmp_path / "computepool", root=True)
    assert "not available" in line and "per process" in line and "RLIMIT_NPROC" in line and "\n" not in line
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    assert cgroups.unheld_warning(tmp_path / "other", root=True) == ""


def test_each_tenants_jobs_share_a_directory_capped_at_its_share_of_the_nodes_pids(tmp_path: Path) -> None:
    """v2 and v1 fake trees: a tenant's jobs sit under `t-<digest>` with pids.max at the tenant's
    share; a job asking more gets no more; the sweep finds a crash's leftovers there too."""
    assert cgroups.tenant_pids_budget(24576) == 12288 and cgroups.tenant_pids_budget(300, 5000) == 300
    acme, zeta = cgroups.tenant_group("acme"), cgroups.tenant_group("zeta/../x")
    assert acme != zeta and acme.startswith("t-") and "/" not in zeta and cgroups.tenant_group("") == ""
    root = tmp_path / "cg2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    v2 = CgroupV2(root / "computepool" / "node-a", pids_budget=300, tenant_pids=120)
    assert v2.usable() == (True, "")
    job = v2.create("a.1", 100, 64, pids_max=1000, group=acme)
    assert job.path == root / "computepool" / "node-a" / acme / "a.1"
    assert (job.path.parent / "pids.max").read_text() == "120" and (
        job.path / "pids.max"
    ).read_text() == "120"
    assert set((job.path.parent / "cgroup.subtree_control").read_text().split()) == {
        "+cpu",
        "+memory",
        "+pids",
    }
    (v2.base / zeta / "7.2").mkdir(parents=True)  # a crash's leftover, another tenant's
    assert v2.sweep({"a.1"}) == ["7.2"] and job.path.is_dir() and (v2.base / zeta).is_dir()
    v1_root = tmp_path / "cg1"
    for c in ("cpu", "memory", "pids"):
        (v1_root / c).mkdir(parents=True)
        (v1_root / c / "cgroup.procs").write_text("")
    v1 = CgroupV1(v1_root, "computepool/node-a", pids_budget=200)
    assert v1.usable() == (True, "") and v1.tenant_pids == 100
    job1 = v1.create("a.1", 100, 64, pids_max=50, group=acme)
    assert job1.paths == tuple(
        v1_root / c / "computepool" / "node-a" / acme / "a.1" for c in ("memory", "cpu", "pids")
    )
    assert (v1_root / "pids" / "computepool" / "node-a" / acme / "pids.max").read_text() == "100"
    assert (job1.paths[2] / "pids.max").read_text() == "50"


@pytest.fixture
def two_tenant_executor() -> Iterator[tuple[Executor, str, str]]:
    if not REAL_V1:
        pytest.skip("needs root and a cgroup v1 memory controller at /sys/fs/cgroup/memory")
    base = Path(f"/sys/fs/cgroup/computepool-test-{uuid.uuid4().hex[:8]}")
    data = Path("/var/tmp") / f"cpool-cg-{uuid.uuid4().hex[:8]}"
    data.mkdir()
    a, b = f"ta{uuid.uuid4().hex[:8]}", f"tb{uuid.uuid4().hex[:8]}"
    ex = Executor(data / "agent", cgroup_base=base, kill_grace_s=1, sandbox=SandboxConfig(tenant_pids_max=40))
    yield ex, a, b
    for rec in ex.running():
        ex.kill(rec.key, "teardown", grace_s=0)
    ex.state.close()
    assert ex.cgroup_dir is not None
    for c in ("memory", "cpu", "pids"):
        top = Path("/sys/fs/cgroup") / c / base.name
        below = (
            sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
            if top.is_dir()
            else []
        )
        cgroups.remove([*below, top])
    shutil.rmtree(data, ignore_errors=True)
    for t in (a, b):
        remove_tenant_user(t)


FORK_ALL = """
import threading, time
held = []
try:
    while len(held) < 1000:
        t = threading.Thread(target=time.sleep, args=(60,), daemon=True)
        t.start()
        held.append(t)
except RuntimeError:
    pass
print(len(held), flush=True)
time.sleep(60)
"""


def test_real_v1_one_tenant_using_its_whole_share_leaves_another_tenant_room(
    two_tenant_executor: tuple[Executor, str, str],
) -> None:
    """Tenant A's job stops at A's share (40 threads) of the node, and A's second job finds no room
    (its wrapper, moved in by the agent, counts but forks nothing); B meanwhile starts 20 threads."""
    ex, a, b = two_tenant_executor
    first = ex.start(JobSpec("a1", 1, [PY, "-c", FORK_ALL], tenant=a))
    out = Path(first.run_dir, "stdout.log")
    deadline = time.monotonic() + 120
    while not out.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 0 < int(out.read_text()) < 40  # each job alone may hold 1024: the tenant's share held it
    group = Path(first.extra["cgroup_paths"].splitlines()[-1]).parent
    assert group.name == cgroups.tenant_group(a) and (group / "pids.max").read_text().strip() == "40"
    ex.start(JobSpec("a2", 1, [PY, "-c", FORK_ALL], tenant=a))  # waits for room that never comes
    twenty = (
        "import threading, time\nts = [threading.Thread(target=time.sleep, args=(0.2,)) for _ in range(20)]\n"
    )
    twenty += "[t.start() for t in ts]\n[t.join() for t in ts]\nprint('ok')"
    other = ex.start(JobSpec("b1", 1, [PY, "-c", twenty], tenant=b))
    done = ex.wait(other.key, 60)
    assert done.state is JobState.SUCCEEDED, Path(other.run_dir, "stderr.log").read_text()
