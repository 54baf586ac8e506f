"""Hold a slice to its share of a device: the job's environment, MPS daemons, the PyTorch shim and
the GPU memory watchdog. What each tier guarantees is written down in docs/isolation.md.

- exclusive, mig: the device alone; its vendor's visible-devices variable names it
  (`CUDA_VISIBLE_DEVICES` a GPU or MIG instance by uuid; AMD, Intel and Ascend take the vendor's
  device indices, core/vendors.py), and every other vendor's is empty.
- mps: one MPS control daemon per device; the client gets an active-thread percentage and a
  pinned device memory limit, enforced by the driver.
- timeslice: CUDA time-slicing; memory is held by a `sitecustomize` shim that caps PyTorch's
  allocator and by the watchdog, which stops a job whose processes hold more than the slice.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from computepool.agent.devices.base import DeviceBackend, DeviceInfo
from computepool.core.allocation import Isolation, Slice
from computepool.core.errors import InvalidInput
from computepool.core.quantities import MILLI_PER_DEVICE
from computepool.core.vendors import VENDORS

# A CUDA context costs a few hundred MiB that no framework allocator sees; the shim's cap leaves
# this much of the slice for it, so a job that fills its allocator still fits the watchdog's line.
DEFAULT_CONTEXT_RESERVE_MIB = 640
MPS_CONTROL = "nvidia-cuda-mps-control"
SHIM_DIR = "cpool-shim"
FRACTION_ENV = "CPOOL_GPU_MEMORY_FRACTION"


class IsolationUnavailable(RuntimeError):
    """The node cannot give this tier right now (no MPS binary, daemon down, not a MIG device…)."""


@dataclass(frozen=True)
class SliceAssignment:
    """A slice resolved to the local device it lives on."""

    device: DeviceInfo
    compute_milli: int
    memory_mib: int
    isolation: Isolation


def resolve_slices(slices: Sequence[Slice], devices: Sequence[DeviceInfo]) -> list[SliceAssignment]:
    """Bind the control plane's slices (by device index) to this node's devices, checking they fit."""
    by_index = {d.index: d for d in devices}
    out = []
    for i, s in enumerate(slices):
        d = by_index.get(s.device_index)
        where = f"slices[{i}]"
        if d is None:
            raise InvalidInput(where, f"no device {s.device_index} on this node ({len(devices)} devices)")
        if s.memory_mib > d.memory_mib:
            raise InvalidInput(
                where, f"{s.memory_mib} MiB is more than device {d.index} holds ({d.memory_mib} MiB)"
            )
        if s.compute_milli > d.compute_milli:
            raise InvalidInput(
                where, f"{s.compute_milli}m is more than device {d.index} has ({d.compute_milli}m)"
            )
        out.append(SliceAssignment(d, s.compute_milli, s.memory_mib, Isolation(s.isolation)))
    return out


def memory_fraction(slice_mib: int, device_mib: int, reserve_mib: int = DEFAULT_CONTEXT_RESERVE_MIB) -> float:
    """Share of the device the framework allocator may use: the slice less the context reserve."""
    usable = max(slice_mib - reserve_mib, slice_mib // 2)
    return max(0.0, min(1.0, math.floor(usable / device_mib * 10_000) / 10_000))


def slice_env(
    allocation_id: str,
    attempt: int,
    slices: Sequence[SliceAssignment],
    job_dir: Path,
    *,
    mps: Mapping[str, MpsDaemon] | None = None,
    user_env: Mapping[str, str] | None = None,
    context_reserve_mib: int = DEFAULT_CONTEXT_RESERVE_MIB,
) -> dict[str, str]:
    """The job's environment: the user's variables, then the slice's (which always win).

    `mps` maps a device uuid to its running daemon (needed for mps slices). For timeslice slices
    the shim is written into `job_dir` and put first on PYTHONPATH.
    """
    tiers = {s.isolation for s in slices}
    if len(tiers) > 1:
        raise InvalidInput("slices", f"one allocation mixes isolation tiers {sorted(tiers)} on a node")
    tier = tiers.pop() if tiers else None
    env = dict(user_env or {})
    uuids = [s.device.uuid for s in slices]
    env |= visible_env([s.device for s in slices])
    env |= {
        "CPOOL_ALLOCATION_ID": allocation_id,
        "CPOOL_ATTEMPT": str(attempt),
        "CPOOL_ISOLATION": tier.value if tier else "none",
        "CPOOL_DEVICE_UUIDS": ",".join(uuids),
        "CPOOL_GPU_COMPUTE_MILLI": ",".join(str(s.compute_milli) for s in slices),
        "CPOOL_GPU_MEMORY_MIB": ",".join(str(s.memory_mib) for s in slices),
        # never join a stray MPS daemon at the default pipe: only mps slices talk to MPS
        "CUDA_MPS_PIPE_DIRECTORY": str(job_dir / "no-mps"),
    }
    if tier is Isolation.MIG:
        for s in slices:
            if not s.device.is_mig:
                raise IsolationUnavailable(f"device {s.device.index} ({s.device.uuid}) is not a MIG instance")
    if tier is Isolation.MPS:
        env |= _mps_env(slices, mps or {})
    if tier in (Isolation.TIMESLICE, Isolation.MPS):
        fractions = [memory_fraction(s.memory_mib, s.device.memory_mib, context_reserve_mib) for s in slices]
        env[FRACTION_ENV] = ",".join(f"{f:.4f}" for f in fractions)
    if tier is Isolation.TIMESLICE:
        shim = write_shim(job_dir)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), env.get("PYTHONPATH", "")) if p)
    return env


def visible_env(devices: Sequence[DeviceInfo]) -> dict[str, str]:
    """Every vendor's visible-devices variables: the job's devices of that vendor (uuids or the
    vendor's indices, as core/vendors.py says it takes them), empty for every other vendor, so a
    job sees no device it does not hold and a CPU-only job none at all. CUDA and HIP read an empty
    list as no device; docs/devices.md says what the others make of it."""
    env: dict[str, str] = {}
    for v in VENDORS.values():
        mine = [d for d in devices if d.vendor.lower() == v.name]
        value = ",".join(d.uuid if v.by_uuid else str(_vendor_index(d)) for d in mine)
        env |= dict.fromkeys(v.visible_env, value)
    return env


def _vendor_index(d: DeviceInfo) -> int:
    return d.physical_index if d.physical_index >= 0 else d.index


def _mps_env(slices: Sequence[SliceAssignment], mps: Mapping[str, MpsDaemon]) -> dict[str, str]:
    if len(slices) != 1:
        raise InvalidInput("slices", f"an mps slice lives on one device, got {len(slices)}")
    s = slices[0]
    daemon = mps.get(s.device.uuid)
    if daemon is None or not daemon.running():
        raise IsolationUnavailable(f"MPS unavailable: no MPS daemon running for {s.device.uuid}")
    pct = max(1, min(100, math.ceil(s.compute_milli * 100 / MILLI_PER_DEVICE)))
    return daemon.client_env() | {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(pct),
        # index form (the client sees its one device as 0): limits given by uuid were found not to
        # apply on some drivers (NVIDIA k8s device plugin 0.15 switched to indices for that reason)
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={s.memory_mib}M",
    }


# ---- the PyTorch shim -----------------------------------------------------------------------

_SHIM = '''\
"""ComputePool timeslice shim: caps PyTorch's CUDA allocator at this slice's share of memory.

Written by the node agent. It costs nothing to a program that never imports torch: it only
leaves a one-shot import hook, and it never initialises CUDA itself (the cap is queued until the
program does). Any error is swallowed: the shim must never break the program it rides in.
"""

import os
import sys


def _cpool_fractions():
    out = []
    for part in os.environ.get("CPOOL_GPU_MEMORY_FRACTION", "").split(","):
        try:
            value = float(part)
        except ValueError:
            continue
        if 0.0 < value <= 1.0:
            out.append(value)
    return out


def _cpool_cap(torch):
    try:
        fractions = _cpool_fractions()
        if not fractions or not torch.cuda.is_available():
            return
        for i in range(torch.cuda.device_count()):
            torch.cuda.set_per_process_memory_fraction(fractions[min(i, len(fractions) - 1)], i)
        os.environ["CPOOL_SHIM_APPLIED"] = "1"
    except Exception:
        pass


def _cpool_on_torch(torch):
    try:
        lazy = getattr(torch.cuda, "_lazy_call", None)
        if lazy is not None:
            lazy(lambda: _cpool_cap(torch))  # runs when the program first initialises CUDA
        else:
            _cpool_cap(torch)
    except Exception:
        pass


class _CpoolTorchFinder:
    """Finds nothing itself; when torch is found by the others, runs a hook after it loads."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        try:
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(name)
            loader = getattr(spec, "loader", None)
            if loader is None or not hasattr(loader, "exec_module"):
                return spec
            original = loader.exec_module

            def exec_module(module):
                original(module)
                _cpool_on_torch(module)

            loader.exec_module = exec_module
            return spec
        except Exception:
            return None


def _cpool_chain():
    """Run the sitecustomize this one shadows (a distribution's, say), as Python would have."""
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        for entry in sys.path:
            if not entry or os.path.abspath(entry) == here:
                continue
            candidate = os.path.join(entry, "sitecustomize.py")
            if os.path.isfile(candidate):
                import importlib.util

                spec = importlib.util.spec_from_file_location("_cpool_next_sitecustomize", candidate)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                return
    except Exception:
        pass


if _cpool_fractions():
    if "torch" in sys.modules:
        _cpool_on_torch(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _CpoolTorchFinder())
_cpool_chain()
'''


def write_shim(job_dir: Path) -> Path:
    """Write `sitecustomize.py` into `<job_dir>/cpool-shim`; returns that directory.

    The job dir is the tenant's, and the agent may write as root: every step goes from a descriptor
    and follows no link, so a `cpool-shim` (or file) its tenant made a link elsewhere is refused
    (OSError), never written through."""
    job_dir.mkdir(parents=True, exist_ok=True)
    nofollow = os.O_NOFOLLOW | os.O_CLOEXEC
    top = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | nofollow)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(SHIM_DIR, 0o777, dir_fd=top)
        shim = os.open(SHIM_DIR, os.O_RDONLY | os.O_DIRECTORY | nofollow, dir_fd=top)
        try:
            tmp = ".sitecustomize.py.tmp"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=shim)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | nofollow, 0o666, dir_fd=shim)
            with os.fdopen(fd, "w") as f:
                f.write(_SHIM)
            os.replace(tmp, "sitecustomize.py", src_dir_fd=shim, dst_dir_fd=shim)
        finally:
            os.close(shim)
    finally:
        os.close(top)
    return job_dir / SHIM_DIR


# ---- MPS ------------------------------------------------------------------------------------


class MpsDaemon:
    """One `nvidia-cuda-mps-control -d` per device, with its own pipe and log directories.

    Each daemon sees only its device (CUDA_VISIBLE_DEVICES=<uuid>), so a client's limits and
    faults stay on that device. Starting it never changes any GPU setting (compute mode included).
    """

    def __init__(self, device_uuid: str, base_dir: Path, binary: str = MPS_CONTROL) -> None:
        self.device_uuid = device_uuid
        self.pipe_dir = base_dir / device_uuid / "pipe"
        self.log_dir = base_dir / device_uuid / "log"
        self.binary = binary

    def available(self) -> tuple[bool, str]:
        if shutil.which(self.binary) is None:
            return False, f"MPS unavailable: {self.binary} not found on PATH"
        return self.reachable()

    def reachable(self) -> tuple[bool, str]:
        """The MPS server runs as its client's uid (a tenant's user), so every directory above the
        pipes must let others pass; else clients fail with CUDA error 805 and nothing says why."""
        if os.geteuid() != 0:
            return True, ""  # a non-root agent's jobs run as its own user
        for d in self.pipe_dir.parent.parent.parents:
            try:
                mode = d.stat().st_mode
            except FileNotFoundError:
                continue  # made below, 0711
            except OSError as e:
                return False, f"MPS unavailable: {d}: {e.strerror}"
            if not mode & 0o001:
                return False, (
                    f"MPS unavailable: tenants' users cannot pass {d} (mode {mode & 0o777:04o}); "
                    "give the agent an --mps-dir they can reach"
                )
        return True, ""

    def _env(self) -> dict[str, str]:
        return dict(os.environ) | {
            "CUDA_VISIBLE_DEVICES": self.device_uuid,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }

    def client_env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def pid(self) -> int | None:
        try:
            return int((self.pipe_dir / "nvidia-cuda-mps-control.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        pid = self.pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the daemon (a no-op if it runs); raises IsolationUnavailable("MPS unavailable: …")."""
        if self.running():
            return
        ok, why = self.available()
        if not ok:
            raise IsolationUnavailable(why)
        self._make_dirs()
        try:
            # umask 022, not the agent's 077: the daemon's sockets must let tenants' clients connect
            # (under 077 they silently ran without MPS, and without its limits, on a real H200)
            done = subprocess.run(
                [self.binary, "-d"], env=self._env(), capture_output=True, text=True, timeout=timeout_s,
                umask=0o022,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            raise IsolationUnavailable(f"MPS unavailable: {e}") from None
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
            raise IsolationUnavailable(f"MPS unavailable: {self.binary} -d: {detail}")
        deadline = time.monotonic() + timeout_s
        while not self.running():
            if time.monotonic() > deadline:
                raise IsolationUnavailable(f"MPS unavailable: daemon did not start (see {self.log_dir})")
            time.sleep(0.05)

    def _make_dirs(self) -> None:
        """Sandboxed jobs run as their tenant's user: they must reach the pipes, not list the agent.

        The daemon's parents pass (0711); the pipe and log directories are readable (0755) so a
        client of another uid can connect, and the MPS server the daemon starts as that uid can
        write its log (1777, sticky: nobody removes another's files).
        """
        for d in (self.pipe_dir.parent.parent, self.pipe_dir.parent):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o711)
        self.pipe_dir.mkdir(exist_ok=True)
        os.chmod(self.pipe_dir, 0o755)
        self.log_dir.mkdir(exist_ok=True)
        os.chmod(self.log_dir, 0o1777)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the daemon to quit (`quit` on its control pipe); clients still running end with it."""
        if not self.running():
            return
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(
                [self.binary],
                input="quit\n",
                env=self._env(),
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)


# ---- the memory watchdog --------------------------------------------------------------------


class JobControl(Protocol):
    """What the watchdog needs from the executor."""

    def job_pids(self, key: str) -> set[int]: ...

    def stop(self, key: str, reason: str, grace_s: float | None = None) -> None: ...


@dataclass(frozen=True)
class Violation:
    key: str
    device_uuid: str
    used_mib: int
    limit_mib: int
    reason: str


class MemoryWatchdog:
    """Stops a job whose processes hold more GPU memory than its slice (on any device).

    The only memory line for timeslice slices that holds whatever framework the job uses; it
    acts after the fact (every `interval_s`), so a burst between two looks is not caught.
    Memory on a device outside the job's slice counts as over a limit of 0.
    """

    def __init__(
        self,
        backend: DeviceBackend,
        control: JobControl,
        *,
        interval_s: float = 2.0,
        kill_grace_s: float = 2.0,
    ) -> None:
        self.backend = backend
        self.control = control
        self.interval_s = interval_s
        self.kill_grace_s = kill_grace_s
        self.violations: list[Violation] = []
        self._limits: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, key: str, limits: Mapping[str, int]) -> None:
        """Watch job `key`; `limits` maps device uuid → MiB its processes may hold there."""
        with self._lock:
            self._limits[key] = dict(limits)

    def watch_slices(self, key: str, slices: Sequence[SliceAssignment]) -> None:
        self.watch(key, {s.device.uuid: s.memory_mib for s in slices})

    def unwatch(self, key: str) -> None:
        with self._lock:
            self._limits.pop(key, None)

    def watched(self) -> list[str]:
        with self._lock:
            return list(self._limits)

    def check_once(self) -> list[Violation]:
        with self._lock:
            watched = {k: dict(v) for k, v in self._limits.items()}
        if not watched:
            return []
        usage = self.backend.usage()
        found = []
        for key, limits in watched.items():
            pids = self.control.job_pids(key)
            if not pids:
                continue
            for u in usage:
                used = sum(mib for pid, mib in u.process_memory_mib.items() if pid in pids)
                limit = limits.get(u.uuid, 0)
                if used <= limit:
                    continue
                if u.uuid in limits:
                    reason = f"GPU memory {used} MiB over slice limit {limit} MiB on {u.uuid}"
                else:
                    reason = f"GPU memory {used} MiB on {u.uuid}, a device outside the slice"
                found.append(Violation(key, u.uuid, used, limit, reason))
                self.control.stop(key, reason, self.kill_grace_s)
                self.unwatch(key)
                break
        self.violations.extend(found)
        return found

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="cpool-memory-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception:  # a failed look must not end the watch
                continue

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
            self._thread = None
