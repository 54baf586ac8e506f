"""Slurm side by side for `cpool bench jobs`: a private one-node cluster on this machine.

Everything lives in a temp dir: a munge key and socket, slurm.conf (free loopback ports, own pid,
log, state and spool paths, no accounting, no cgroups), so a system Slurm (if any) is never
touched. munged, slurmctld and slurmd run in the foreground as our children and are stopped in
`stop()` whatever happened. The node has `slots` CPUs (`SlurmdParameters=config_overrides`: more
than the machine has), so `sbatch --wrap true` jobs of one CPU each run `slots` at a time — the
same slots as the pool side.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from computepool.client.bench import percentile

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "squeue", "scontrol")
READY_TIMEOUT_S = 60.0
NODE = "cpoolbench1"

# batch_sched_delay=0: a batch job is scheduled at submit time, not up to 3 s later
TUNED = "batch_sched_delay=0"


def slurm_available() -> bool:
    return all(shutil.which(b) or Path("/usr/sbin", b).exists() for b in DAEMONS + CLIENTS)


def _bin(name: str) -> str:
    found = shutil.which(name) or str(Path("/usr/sbin", name))
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class SlurmSettings:
    jobs: int = 500
    samples: int = 20
    slots: int = 20
    poll_s: float = 0.25
    scheduler_parameters: str | None = TUNED  # None: Slurm's defaults
    drain_timeout_s: float = 600.0


class LocalSlurm:
    """munged + slurmctld + slurmd with a private slurm.conf; a context manager."""

    def __init__(self, slots: int, scheduler_parameters: str | None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="cpool-bench-slurm-")
        self.root = Path(self._tmp.name)
        self.slots = slots
        self.scheduler_parameters = scheduler_parameters
        self.conf = self.root / "slurm.conf"
        self.sock = self.root / "munge.socket"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for k in list(self.env):
            if k.startswith("SLURM_") and k != "SLURM_CONF":
                del self.env[k]

    def _write(self) -> None:
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(mode=0o700)
        key = self.root / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        mem = max(1024, psutil.virtual_memory().total // 2**20 // 2)
        lines = [
            "ClusterName=cpoolbench",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.sock}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "ReturnToService=2",
            "MinJobAge=2",
            "MaxJobCount=100000",
            f"NodeName={NODE} NodeHostname=localhost NodeAddr=127.0.0.1 CPUs={self.slots} "
            f"RealMemory={mem} State=UNKNOWN",
            f"PartitionName=bench Nodes={NODE} Default=YES MaxTime=INFINITE State=UP",
        ]
        if self.scheduler_parameters:
            lines.append(f"SchedulerParameters={self.scheduler_parameters}")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - closed with the child
        with log:
            self.procs[name] = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env
            )

    def _tail(self, name: str) -> str:
        for f in (self.root / "log" / f"{name}.log", self.root / "log" / f"{name}.out"):
            with contextlib.suppress(OSError):
                lines = [ln for ln in f.read_text(errors="replace").splitlines() if ln.strip()]
                if lines:
                    return lines[-1]
        return ""

    def _check(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited ({p.returncode}): {self._tail(name)}")

    def start(self) -> None:
        self._write()
        self._spawn(
            "munged",
            [
                _bin("munged"), "-F", "-f", f"--socket={self.sock}",
                f"--key-file={self.root / 'munge.key'}", f"--pid-file={self.root / 'munged.pid'}",
                f"--log-file={self.root / 'log' / 'munged.log'}", f"--seed-file={self.root / 'munged.seed'}",
            ],
        )  # fmt: skip
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.sock.exists():
            self._check()
            if time.monotonic() > deadline:
                raise RuntimeError("munged made no socket")
            time.sleep(0.05)
        self._spawn("slurmctld", [_bin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [_bin("slurmd"), "-D", "-N", NODE, "-f", str(self.conf)])
        while True:
            self._check()
            r = subprocess.run(
                [_bin("sinfo"), "-h", "-N", "-o", "%t"], env=self.env, capture_output=True, text=True
            )
            if r.returncode == 0 and r.stdout.strip() == "idle":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Slurm node is not idle after {READY_TIMEOUT_S:g} s: {r.stdout}{r.stderr}"
                )
            time.sleep(0.2)

    def cpu_s(self) -> float:
        """munged, slurmctld and slurmd's own CPU time (not slurmstepd's, which runs each job)."""
        total = 0.0
        for p in self.procs.values():
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(p.pid).cpu_times()
                total += t.user + t.system
        return total

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            subprocess.run(
                [_bin("scancel"), "--partition=bench"], env=self.env, capture_output=True, timeout=10
            )
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        with contextlib.suppress(OSError):
            self._tmp.cleanup()

    def __enter__(self) -> LocalSlurm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def run(self, argv: Sequence[str], timeout_s: float = 120.0) -> str:
        r = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({r.returncode}): {r.stderr.strip()[-300:]}")
        return r.stdout

    def queued(self) -> int:
        return len(self.run([_bin("squeue"), "-h", "-o", "%i", "-t", "PD,R,CF,CG"]).split())


def run_slurm_bench(s: SlurmSettings) -> dict[str, Any]:
    """srun e2e on the idle cluster, then `jobs` sbatch jobs submitted and drained."""
    with LocalSlurm(s.slots, s.scheduler_parameters) as cluster:
        e2e: list[float] = []
        for _ in range(s.samples):
            t0 = time.perf_counter()
            cluster.run([_bin("srun"), "-n1", "true"])
            e2e.append((time.perf_counter() - t0) * 1000)
        cpu0 = cluster.cpu_s()
        t0 = time.perf_counter()
        for _ in range(s.jobs):
            cluster.run([_bin("sbatch"), "-n1", "-o", "/dev/null", "--wrap", "true"])
        submitted = time.perf_counter()
        deadline = time.monotonic() + s.drain_timeout_s
        while cluster.queued() > 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm jobs not drained after {s.drain_timeout_s:g} s")
            time.sleep(s.poll_s)
        drained = time.perf_counter()
        cpu = cluster.cpu_s() - cpu0
    span = drained - t0
    return {
        "e2e_p50_ms": percentile(e2e, 50),
        "e2e_p99_ms": percentile(e2e, 99),
        "jobs_per_s": round(s.jobs / span, 2) if span > 0 else None,
        "daemon_cpu_s_per_100_jobs": round(cpu * 100 / s.jobs, 3),
        "submit_s": round(submitted - t0, 3),
        "jobs": s.jobs,
        "slots": s.slots,
        "scheduler_parameters": s.scheduler_parameters or "(default)",
    }
