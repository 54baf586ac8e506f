"""MIG placement where the GPU already has MIG instances: the scheduler (the one the pool and the
simulator share) on this node's real inventory, then a job on the instance it chose.

MIG mode and the instances are taken as they are: nothing here creates, destroys or reconfigures
anything. Without instances the checks are skipped with the reason.
"""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
from gpu_check_common import last_json, record, tail

from computepool.agent.devices import DeviceInfo
from computepool.agent.executor import STDERR_LOG, STDOUT_LOG, Executor, JobSpec
from computepool.agent.isolation import SliceAssignment, slice_env
from computepool.agent.localstate import JobState
from computepool.core import Isolation, Node, Request
from computepool.scheduler.placement import Scheduler
from computepool.scheduler.policies import make_scorer
from computepool.scheduler.state import ClusterState

MIB = 1024 * 1024

# Run on the instance: what CUDA_VISIBLE_DEVICES lets PyTorch see (or only the env without torch).
TORCH_PROBE = r"""
import json, os
out = {"cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "isolation": os.environ.get("CPOOL_ISOLATION")}
if os.environ.get("CPOOL_CHECK_TORCH") == "1":
    import torch
    out["count"] = torch.cuda.device_count()
    p = torch.cuda.get_device_properties(0)
    out.update(name=p.name, memory_mib=p.total_memory // 2**20, sm=p.multi_processor_count)
    x = torch.ones(1 << 24, device="cuda")  # every partial sum is exact in float32
    out["sum_ok"] = float(x.sum()) == float(1 << 24)
print(json.dumps(out), flush=True)
"""


def node_of(devices: list[DeviceInfo]) -> Node:
    cpu_milli = (psutil.cpu_count() or 1) * 1000
    return Node(
        "this-node", cpu_milli, psutil.virtual_memory().total // MIB, [d.to_device() for d in devices]
    )


def check_placement(devices: list[DeviceInfo]) -> DeviceInfo | None:
    """The scheduler's answers on this node's inventory; returns the instance a `--mig` request got."""
    migs = [d for d in devices if d.is_mig]
    sched = Scheduler(make_scorer("default"))
    state = ClusterState.from_nodes([node_of(devices)])
    by_index = {d.index: d for d in devices}
    profile = migs[0].to_device().mig_profile
    got = sched.place(state, Request(gpu_count=1, gpu_milli=1000, mig_profile=profile))
    placed = [by_index[i] for i in got.placements[0].devices] if got.ok else []
    ok = len(placed) == 1 and placed[0].is_mig and placed[0].to_device().mig_profile == profile
    record(
        f"mig: --mig {profile} placed on an instance of that profile",
        "PASS" if ok else "FAIL",
        f"{[(d.index, d.model, d.uuid) for d in placed]}" if got.ok else f"refused: {got.reasons}",
    )
    chosen = placed[0] if ok else None

    smallest = min(migs, key=lambda d: (d.memory_mib, d.compute_milli))
    d2 = sched.place(state, Request(gpu_count=1, gpu_milli=1000, isolation=Isolation.MIG))
    on = [by_index[i] for i in d2.placements[0].devices] if d2.ok else []
    ok = len(on) == 1 and on[0].is_mig and on[0].memory_mib == smallest.memory_mib
    record(
        "mig: --isolation mig takes the smallest instance",
        "PASS" if ok else "FAIL",
        f"got {[(d.index, d.model) for d in on]}, smallest {smallest.model}"
        if d2.ok
        else f"refused: {d2.reasons}",
    )

    for label, req in (
        ("whole-GPU request", Request(gpu_count=1, gpu_milli=1000)),
        ("timeslice request", Request(gpu_count=1, gpu_milli=500)),
    ):
        d3 = sched.place(state, req)
        on = [by_index[i] for i in d3.placements[0].devices] if d3.ok else []
        ok = not any(d.is_mig for d in on)
        where = f"placed on {[(d.index, d.model) for d in on]}" if d3.ok else f"refused: {d3.reasons}"
        record(f"mig: a {label} never lands on an instance", "PASS" if ok else "FAIL", where)

    # every instance taken: one more MIG request waits instead of sharing one
    filled = state.copy()
    for _ in migs:
        sched.schedule(filled, Request(gpu_count=1, gpu_milli=1000, isolation=Isolation.MIG))
    extra = sched.place(filled, Request(gpu_count=1, gpu_milli=1000, isolation=Isolation.MIG))
    record(
        "mig: an instance holds one allocation",
        "PASS" if not extra.ok else "FAIL",
        f"after {len(migs)} MIG allocations: " + ("placed" if extra.ok else f"refused: {extra.reasons}"),
    )
    return chosen


def check_job_on_instance(work: Path, instance: DeviceInfo, with_torch: bool) -> None:
    """A process job on the instance: CUDA_VISIBLE_DEVICES names it and torch sees its memory only."""
    executor = Executor(work / "mig-agent", cgroup_base=None, kill_grace_s=3)
    slices = [SliceAssignment(instance, instance.compute_milli, instance.memory_mib, Isolation.MIG)]
    env = slice_env("mig-job", 1, slices, work / "mig-job")
    env["CPOOL_CHECK_TORCH"] = "1" if with_torch else "0"
    script = work / "mig_probe.py"
    script.write_text(TORCH_PROBE)
    rec = executor.start(JobSpec("mig-job", 1, [sys.executable, str(script)], env=env, uses_gpu=True))
    done = executor.wait(rec.key, 120)
    if done.state is JobState.RUNNING:
        done = executor.kill(rec.key, "check timed out", grace_s=2)
    rep = last_json(Path(done.run_dir) / STDOUT_LOG)
    env_ok = rep.get("cvd") == instance.uuid and rep.get("isolation") == "mig"
    if not with_torch:
        record(
            "mig: job env names the instance",
            "PASS" if done.state is JobState.SUCCEEDED and env_ok else "FAIL",
            f"{rep} (instance {instance.uuid}) {done.reason} {tail(Path(done.run_dir) / STDERR_LOG)}",
        )
        record("mig: torch sees the instance's memory", "SKIP", "no PyTorch or no real GPU")
        return
    mem = rep.get("memory_mib")
    mem_ok = isinstance(mem, int) and abs(mem - instance.memory_mib) <= max(512, instance.memory_mib // 50)
    ok = done.state is JobState.SUCCEEDED and env_ok and mem_ok
    ok = ok and rep.get("count") == 1 and rep.get("sum_ok") is True
    record(
        "mig: torch sees the instance's memory",
        "PASS" if ok else "FAIL",
        f"{rep} (instance {instance.model} {instance.memory_mib} MiB {instance.uuid}); "
        f"{done.state} {done.reason} {'' if ok else tail(Path(done.run_dir) / STDERR_LOG)}",
    )


def run_mig_checks(work: Path, devices: list[DeviceInfo], with_torch: bool) -> DeviceInfo | None:
    """Placement and a job on an instance; the instance used, for the container check (or None)."""
    if not any(d.is_mig for d in devices):
        record("mig placement", "SKIP", "no MIG instances on this node (MIG mode is never changed here)")
        return None
    instance = check_placement(devices)
    if instance is None:
        return None
    check_job_on_instance(work, instance, with_torch)
    return instance
