"""Check the agent's isolation on a real NVIDIA GPU; prints a pass/fail/skip table (and JSON into $OUT).

Run by scripts/gpu-check.sh. Only reads GPU state and starts ordinary CUDA processes (plus an
MPS control daemon with its own pipe directory, stopped at the end, and podman containers that
are removed when their job ends): it never changes MIG mode, compute mode, clocks or anything
else, and never resets a GPU. Parts: gpu_check_container.py (container jobs through podman),
gpu_check_mig.py (MIG placement where instances exist).

`--dry-run` takes simulated devices instead of NVML (a machine without a GPU): the checks that
need CUDA are skipped, the container path and MIG placement still run as far as they can.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from gpu_check_common import RESULTS, guarded, record
from gpu_check_container import ContainerRunner, check_probe, clean_up, run_container_checks
from gpu_check_mig import run_mig_checks

from computepool.agent.devices import DeviceInfo, NvidiaBackend, SimulatedBackend, discover_all
from computepool.agent.devices.base import DeviceUsage
from computepool.agent.executor import STDERR_LOG, STDOUT_LOG, Executor, JobSpec
from computepool.agent.isolation import MemoryWatchdog, MpsDaemon, SliceAssignment, slice_env
from computepool.agent.localstate import JobRecord, JobState
from computepool.core import Isolation

DRY_RUN_DEVICES = "1xA100-80GB,1xA100-80GB:mig=3g.40gb+2g.20gb+2g.20gb"
SLICE_MIB = 8192

# Allocates `step` MiB at a time up to `cap` MiB (or until the allocator refuses), reports, holds.
ALLOC = r"""
import json, os, sys, time
step, cap, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
out = {"cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}
try:
    import torch
except ImportError:
    print(json.dumps(dict(out, error="no torch")), flush=True)
    sys.exit(3)
out["visible"] = torch.cuda.device_count()
out["sm"] = torch.cuda.get_device_properties(0).multi_processor_count
keep, total, oom = [], 0, ""
try:
    while total < cap:
        keep.append(torch.empty(step * 2**20, dtype=torch.uint8, device="cuda"))
        total += step
except torch.cuda.OutOfMemoryError as e:
    oom = str(e).splitlines()[0][:200]
torch.cuda.synchronize()
out.update(allocated_mib=total, oom=oom, shim=os.environ.get("CPOOL_SHIM_APPLIED", ""))
print(json.dumps(out), flush=True)
time.sleep(hold)
"""


def has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def report_of(rec: JobRecord) -> dict[str, object]:
    text = (Path(rec.run_dir) / STDOUT_LOG).read_text().strip().splitlines()
    try:
        return json.loads(text[-1]) if text else {}
    except ValueError:
        return {"raw": text[-1]}


def stderr_tail(rec: JobRecord) -> str:
    try:
        return (Path(rec.run_dir) / STDERR_LOG).read_text()[-300:].strip()
    except OSError:
        return ""


class Ctx:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.backend = NvidiaBackend()
        self.executor = Executor(work / "agent", cgroup_base=None, kill_grace_s=3)
        self.devices: list[DeviceInfo] = []
        self.peaks: dict[str, int] = {}

    def alloc_job(self, name: str, env: dict[str, str], args: list[str], isolated: bool = False) -> JobRecord:
        script = self.work / "alloc.py"
        script.write_text(ALLOC)
        py = [sys.executable, "-I"] if isolated else [sys.executable]  # -I: no PYTHONPATH, no shim
        return self.executor.start(JobSpec(name, 1, [*py, str(script), *args], env=env, uses_gpu=True))

    def state_of(self, rec: JobRecord) -> JobState:
        now = self.executor.get(rec.key)
        return now.state if now is not None else rec.state

    def wait_sampling(self, recs: list[JobRecord], timeout: float) -> list[JobRecord]:
        """Wait for jobs, noting the most GPU memory NVML saw each hold (for the report)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(self.state_of(r) is JobState.RUNNING for r in recs):
            usage = self.backend.usage()
            for r in recs:
                pids = self.executor.job_pids(r.key)
                seen = sum(m for u in usage for p, m in u.process_memory_mib.items() if p in pids)
                self.peaks[r.key] = max(self.peaks.get(r.key, 0), seen)
            self.executor.poll()
            time.sleep(0.2)
        out = []
        for r in recs:
            if self.state_of(r) is JobState.RUNNING:
                self.executor.kill(r.key, "check timed out", grace_s=2)
            out.append(self.executor.wait(r.key, 10))
        return out


def gpu_expected() -> bool:
    """A driver is installed (nvidia-smi or /dev/nvidiactl): then NVML must answer."""
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidiactl").exists()


def check_discovery(ctx: Ctx) -> None:
    if not ctx.backend.available():
        record("nvml discovery", "FAIL" if gpu_expected() else "SKIP", ctx.backend.reason)
        return
    ctx.devices = ctx.backend.discover()
    inv = discover_all(None)
    migs = ctx.backend.mig_modes()
    desc = "; ".join(
        f"#{d.index} {d.model} {d.memory_mib} MiB cc {d.compute_capability} numa {d.numa_node} "
        f"link '{d.link_group}' {d.uuid}"
        + (f" (MIG of {d.mig_parent_uuid}, {d.compute_milli}m)" if d.is_mig else "")
        for d in ctx.devices
    )
    ok = bool(ctx.devices) and len(inv.devices) == len(ctx.devices) and all(d.uuid for d in ctx.devices)
    record("nvml discovery", "PASS" if ok else "FAIL", f"{len(ctx.devices)} device(s): {desc}")
    record("mig mode", "INFO", ", ".join(f"{u}: {'enabled' if on else 'disabled'}" for u, on in migs.items()))
    usage = ctx.backend.usage()
    record(
        "nvml usage",
        "PASS" if len(usage) == len(ctx.devices) else "FAIL",
        "; ".join(
            f"#{u.index} util {u.utilization_pct}% {u.memory_used_mib} MiB pids {list(u.process_memory_mib)}"
            f" power {u.power_w} W energy {u.energy_j} J health {u.health or 'ok'}"
            for u in usage
        ),
    )
    check_power(ctx, usage)


def check_power(ctx: Ctx, first: list[DeviceUsage]) -> None:
    """What the usage ledger books: each whole GPU's power and its energy counter, which must grow."""
    time.sleep(1.0)
    later = {u.index: u for u in ctx.backend.usage()}
    whole = {d.index for d in ctx.devices if not d.is_mig}
    rows, ok = [], True
    for u in first:
        if u.index not in whole:
            continue
        v = later.get(u.index)
        grew = None if u.energy_j is None or v is None or v.energy_j is None else v.energy_j - u.energy_j
        ok = ok and u.power_w is not None and u.power_w > 0 and (grew is None or grew > 0) and not u.health
        rows.append(f"#{u.index} {u.power_w} W, energy +{grew} J in 1 s, health {u.health or 'ok'}")
    record("nvml power and energy", "PASS" if ok and rows else "FAIL", "; ".join(rows) or "no whole GPU")


def whole_gpu(ctx: Ctx) -> DeviceInfo | None:
    return next((d for d in ctx.devices if not d.is_mig), None)


def check_exclusive(ctx: Ctx) -> None:
    gpu = ctx.devices[0]
    tier = Isolation.MIG if gpu.is_mig else Isolation.EXCLUSIVE
    env = slice_env(
        "excl", 1, [SliceAssignment(gpu, gpu.compute_milli, gpu.memory_mib, tier)], ctx.work / "excl"
    )
    rec = ctx.alloc_job("excl", env, ["256", "256", "0"])
    (done,) = ctx.wait_sampling([rec], 60)
    rep = report_of(done)
    ok = done.state is JobState.SUCCEEDED and rep.get("visible") == 1 and rep.get("cvd") == gpu.uuid
    record(
        f"{tier} slice alone",
        "PASS" if ok else "FAIL",
        f"{rep} {done.reason} {stderr_tail(done) if not ok else ''}",
    )


def check_timeslice(ctx: Ctx) -> None:
    gpu = whole_gpu(ctx)
    if gpu is None:
        record("timeslice shim", "SKIP", "every GPU is in MIG mode")
        return
    watchdog = MemoryWatchdog(ctx.backend, ctx.executor, interval_s=0.5, kill_grace_s=1)
    slices = [SliceAssignment(gpu, 500, SLICE_MIB, Isolation.TIMESLICE)]
    recs = []
    for name in ("ts-a", "ts-b"):
        env = slice_env(name, 1, slices, ctx.work / name)
        recs.append(ctx.alloc_job(name, env, ["256", str(3 * SLICE_MIB), "4"]))
        watchdog.watch_slices(recs[-1].key, slices)
    watchdog.start()
    try:
        done = ctx.wait_sampling(recs, 90)
    finally:
        watchdog.close()
    for d in done:
        rep = report_of(d)
        alloc = int(rep.get("allocated_mib", -1))  # type: ignore[call-overload]
        ok = (
            d.state is JobState.SUCCEEDED
            and bool(rep.get("oom"))
            and 0 < alloc <= SLICE_MIB
            and rep.get("shim") == "1"
        )
        detail = (
            f"allocator stopped at {alloc} MiB of a {SLICE_MIB} MiB slice (oom: {str(rep.get('oom'))[:80]}); "
            f"NVML peak {ctx.peaks.get(d.key)} MiB; state {d.state} {d.reason} {'' if ok else stderr_tail(d)}"
        )
        record(f"timeslice shim holds {d.allocation_id}", "PASS" if ok else "FAIL", detail)

    # a process that bypasses the shim (python -I ignores PYTHONPATH) is stopped by the watchdog
    watchdog = MemoryWatchdog(ctx.backend, ctx.executor, interval_s=0.5, kill_grace_s=1)
    env = slice_env("ts-bypass", 1, slices, ctx.work / "ts-bypass")
    rec = ctx.alloc_job("ts-bypass", env, ["1024", str(2 * SLICE_MIB), "60"], isolated=True)
    watchdog.watch_slices(rec.key, slices)
    watchdog.start()
    try:
        (d,) = ctx.wait_sampling([rec], 60)
    finally:
        watchdog.close()
    ok = d.state is JobState.KILLED and d.reason.startswith("GPU memory") and "over slice limit" in d.reason
    hint = "" if ok else f" (NVML peak {ctx.peaks.get(d.key)} MiB; pid namespace or NVML process accounting?)"
    record("watchdog stops a shim bypass", "PASS" if ok else "FAIL", f"{d.state}: {d.reason}{hint}")


def check_mps(ctx: Ctx) -> None:
    gpu = ctx.devices[0]
    daemon = MpsDaemon(gpu.uuid, ctx.work / "mps")
    ok, why = daemon.available()
    if not ok:
        record("mps limits", "SKIP", why)
        return
    try:
        daemon.start()
    except Exception as e:
        record("mps limits", "SKIP", str(e))
        return
    try:
        mem = 4096
        slices = [SliceAssignment(gpu, 250, mem, Isolation.MPS)]
        env = slice_env("mps", 1, slices, ctx.work / "mps-job", mps={gpu.uuid: daemon})
        rec = ctx.alloc_job("mps", env, ["256", str(3 * mem), "1"])
        (d,) = ctx.wait_sampling([rec], 60)
        rep = report_of(d)
        alloc = int(rep.get("allocated_mib", -1))  # type: ignore[call-overload]
        passed = d.state is JobState.SUCCEEDED and bool(rep.get("oom")) and 0 < alloc <= mem
        record(
            "mps pinned memory limit",
            "PASS" if passed else "FAIL",
            f"stopped at {alloc} MiB of {mem} MiB; {d.state} {d.reason} {'' if passed else stderr_tail(d)}",
        )
        record("mps active thread %", "INFO", f"25% asked; SMs seen by the client: {rep.get('sm')}")
    finally:
        daemon.stop()
        record("mps daemon stopped", "PASS" if not daemon.running() else "FAIL", str(daemon.pipe_dir))


def simulated_discovery(ctx: Ctx, spec: str) -> None:
    ctx.devices = SimulatedBackend(spec).discover()
    desc = "; ".join(f"#{d.index} {d.model} {d.memory_mib} MiB {d.uuid}" for d in ctx.devices)
    record("discovery (simulated)", "INFO", f"--dry-run {spec}: {desc}")


def on_mig(runner: ContainerRunner, instance: DeviceInfo) -> None:
    """The container path again, on the MIG instance the scheduler chose (its capability nodes)."""
    guarded("container on mig", lambda: check_probe(runner, instance, f"on MIG {instance.model}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="simulated devices instead of NVML")
    parser.add_argument("--simulate", default=DRY_RUN_DEVICES, help="the devices of a dry run")
    parser.add_argument(
        "--image",
        choices=("auto", "host", "test"),
        default="auto",
        help="container image: built from the host (GPU probe) or localhost/pybase:1 (auto: test if dry run)",
    )
    args = parser.parse_args(argv)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    work = Path(tempfile.mkdtemp(prefix="cpool-gpu-check-"))
    ctx = Ctx(work)
    started = time.monotonic()
    print(f"ComputePool GPU check (work dir {work}){' - dry run' if args.dry_run else ''}", flush=True)
    if args.dry_run:
        guarded("discovery (simulated)", lambda: simulated_discovery(ctx, args.simulate))
    else:
        guarded("nvml discovery", lambda: check_discovery(ctx))
    real = bool(ctx.devices) and not args.dry_run
    if real and has_torch():
        guarded("exclusive slice alone", lambda: check_exclusive(ctx))
        guarded("timeslice", lambda: check_timeslice(ctx))
        guarded("mps", lambda: check_mps(ctx))
    else:
        why = "PyTorch is not installed" if real else "no NVIDIA GPU (dry run or CPU machine)"
        record("exclusive, timeslice, mps on a GPU", "SKIP", why)
    for rec in ctx.executor.running():
        ctx.executor.kill(rec.key, "check finished", grace_s=1)
    test_image = args.image == "test" or (args.image == "auto" and args.dry_run)
    if ctx.devices:
        runner = guarded("container path", lambda: run_container_checks(work, ctx.devices, test_image))
        instance = guarded("mig", lambda: run_mig_checks(work, ctx.devices, real and has_torch()))
        if runner is not None and instance is not None:
            on_mig(runner, instance)
        clean_up(runner)
    else:
        record("container path, mig placement", "SKIP", "no devices found (see nvml discovery)")
    record("duration", "INFO", f"{time.monotonic() - started:.0f} s")

    width = max(len(r["check"]) for r in RESULTS)
    table = [f"{'check':<{width}}  status  detail", "-" * (width + 40)]
    table += [f"{r['check']:<{width}}  {r['status']:<6}  {r['detail']}" for r in RESULTS]
    print("\n" + "\n".join(table), flush=True)
    failed = [r for r in RESULTS if r["status"] == "FAIL"]
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gpu-check.json").write_text(json.dumps(RESULTS, indent=2))
        (out_dir / "gpu-check.txt").write_text("\n".join(table) + "\n")
        for agent in ("agent", "container-agent", "mig-agent"):
            runs = work / agent / "runs"
            if runs.exists():
                shutil.copytree(
                    runs,
                    out_dir / "runs" / agent,
                    dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.py", "cpool-shim"),
                )
    counts = {k: sum(r["status"] == k for r in RESULTS) for k in ("PASS", "FAIL", "SKIP", "INFO")}
    print("\n" + ", ".join(f"{n} {k.lower()}" for k, n in counts.items()), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
