"""Simulated devices for machines without accelerators (tests, demos) that behave like real ones.

The agent tells the backend which process runs on which device (`attach`/`detach`), as the
driver would see it; processes that exit are dropped on their own. A workload can also claim to
use some GPU memory by writing a number of MiB into the file named by `CPOOL_SIM_MEMORY_FILE`,
so the memory watchdog can be exercised without a GPU.

Power follows utilization through the pool's power model (core/power.py: idle to peak watts
per model, with their sources), and each whole GPU keeps a total-energy counter in joules from
the backend's start, as NVML keeps one from the driver's load, so the ledger books simulated
energy the way it books real energy. The draw between two looks is taken as it was at the first
(attaching or detaching a process books up to that moment). A MIG instance reports no power of
its own, as on real GPUs.

A simulated GPU can be split into MIG instances (`1xA100-80GB:mig=3g.40gb+2g.20gb+2g.20gb`):
each instance is reported as NVML reports a real one — a device of its own with a `MIG-` uuid,
its parent GPU's uuid, the profile's memory, and `compute_milli = 1000 × slices / 7`.

Other vendors' models are simulated as those vendors' devices (`2xMI300X,4xAscend910B,1xM2-Ultra`):
a model of the catalog (devices/catalog.py) needs no memory suffix and takes the catalog's vendor,
so the scheduler and the job's environment treat it as that vendor's. Their uuids are
`<vendor>-sim-…`, never `GPU-`/`MIG-`, which name real NVIDIA devices to the container code.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import threading
import time
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from computepool.agent.devices.base import DeviceInfo, DeviceUsage
from computepool.agent.devices.catalog import known_model, known_names
from computepool.core.errors import InvalidInput
from computepool.core.power import PowerModel, model_power
from computepool.core.quantities import MILLI_PER_DEVICE
from computepool.core.request import MAX_DEVICES_PER_NODE
from computepool.core.resources import MIG_PROFILE

SIM_MEMORY_FILE_ENV = "CPOOL_SIM_MEMORY_FILE"
SIM_MEMORY_FILE_NAME = "sim_gpu_memory_mib"

# GPU memory is sold in GB that are really GiB (an "80GB" A100 has 81920 MiB), so G means GiB here.
_UNIT_MIB = {"t": 1024 * 1024, "tb": 1024 * 1024, "tib": 1024 * 1024, "ti": 1024 * 1024}
_UNIT_MIB |= {"g": 1024, "gb": 1024, "gib": 1024, "gi": 1024, "m": 1, "mb": 1, "mib": 1, "mi": 1}
_ENTRY = re.compile(
    r"^(?:(?P<count>\d+)\s*[xX*]\s*)?(?:(?P<vendor>[A-Za-z][A-Za-z0-9_]*)/)?"
    r"(?P<model>[A-Za-z0-9][A-Za-z0-9_.\-]*?)-(?P<mem>\d+(?:\.\d+)?)(?P<unit>[A-Za-z]+)$"
)
_JSON_FIELDS = {"model", "memory_mib", "count", "vendor", "compute_capability", "numa_node", "link_group"}
_JSON_FIELDS |= {"mig"}
_BARE = re.compile(
    r"^(?:(?P<count>\d+)\s*[xX*]\s*)?(?:(?P<vendor>[A-Za-z][A-Za-z0-9_]*)/)?(?P<model>[A-Za-z0-9][A-Za-z0-9_.\-]*)$"
)
MIG_SLICES = 7  # GPU-instance slices of a simulated GPU (as on A100 and H100)
MIG_SIZES = (1, 2, 3, 4, 7)  # the GPU-instance sizes NVIDIA defines, in slices
_MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class SimDeviceSpec:
    """One line of a simulated inventory: `count` devices of one model."""

    model: str
    memory_mib: int
    count: int = 1
    vendor: str = "nvidia"
    compute_capability: str = ""
    numa_node: int = -1
    link_group: str = ""
    mig: tuple[str, ...] = ()  # MIG instances each of these GPUs is split into (profiles)


def parse_mig(where: str, text: str, gpu_memory_mib: int) -> tuple[str, ...]:
    """`3g.40gb+2g.20gb+2g.20gb` → the profiles, checked against the GPU's 7 slices and memory."""
    tokens = [t.strip() for t in text.split("+")]
    profiles: list[str] = []
    for t in tokens:
        if t == "me" and profiles and not profiles[-1].endswith("+me"):
            profiles[-1] += "+me"  # `1g.10gb+me` (the media-engine variant) is one profile
        else:
            profiles.append(t)
    if not profiles or profiles == [""]:
        raise InvalidInput(where, "mig= lists no instance (expected e.g. mig=3g.40gb+2g.20gb+2g.20gb)")
    slices = mem = 0
    for prof in profiles:
        m = MIG_PROFILE.match(prof)
        if m is None or int(m["slices"]) not in MIG_SIZES:
            raise InvalidInput(
                where, f"unknown MIG profile {prof!r} (expected SLICESg.MEMORYgb, slices one of 1,2,3,4,7)"
            )
        slices += int(m["slices"])
        mem += int(m["gb"]) * 1024
    if slices > MIG_SLICES:
        raise InvalidInput(
            where, f"MIG instances {text} take {slices} slices, more than the GPU's {MIG_SLICES}"
        )
    if mem > gpu_memory_mib:
        raise InvalidInput(
            where, f"MIG instances {text} take {mem} MiB, more than the GPU's {gpu_memory_mib} MiB"
        )
    return tuple(profiles)


def parse_spec(spec: str) -> list[SimDeviceSpec]:
    """`2xA100-80GB,1xT4-16GB` (optionally `vendor/MODEL-MEM`, and `:mig=P+P+…` to split each of
    those GPUs into MIG instances of profiles P) or the path of a JSON file."""
    text = spec.strip()
    if not text:
        raise InvalidInput("simulate", "empty device spec (expected e.g. 2xA100-80GB,1xT4-16GB)")
    if text.endswith(".json") or Path(text).is_file():
        return _parse_json(Path(text))
    out = []
    for part in text.split(","):
        part = part.strip()
        part, _, extra = part.partition(":")
        where = f"simulate: {part + (':' + extra if extra else '')!r}"
        s = _entry(spec, part, where)
        if extra:
            key, eq, value = extra.partition("=")
            if key.strip() != "mig" or not eq:
                raise InvalidInput(where, f"unknown option {extra!r} (expected mig=PROFILE+PROFILE…)")
            if s.vendor != "nvidia":
                raise InvalidInput(where, f"mig= splits NVIDIA GPUs only, not {s.vendor} devices")
            s = replace(s, mig=parse_mig(where, value, s.memory_mib))
        out.append(s)
    _check_total(spec, out)
    return out


def _entry(spec: str, part: str, where: str) -> SimDeviceSpec:
    """One `COUNTxMODEL-MEMORY` entry, or `COUNTxMODEL` of a model the catalog knows."""
    m = _ENTRY.match(part)
    if m is None:
        bare = _BARE.match(part)
        known = known_model(bare["model"]) if bare else None
        if bare is None:
            raise InvalidInput(
                "simulate", f"cannot read {part!r} in {spec!r} (expected COUNTxMODEL-MEMORY like 2xA100-80GB)"
            )
        if known is None:
            raise InvalidInput(
                "simulate",
                f"unknown model {bare['model']!r} in {part!r}: give its memory (like {part}-80GB), or name a "
                f"model of known memory: {known_names()}",
            )
        count = int(bare["count"]) if bare["count"] is not None else 1
        return _checked(
            where, known.name, known.memory_mib, count, _vendor_of(where, bare["vendor"], known.name)
        )
    factor = _UNIT_MIB.get(m["unit"].lower())
    if factor is None:
        raise InvalidInput("simulate", f"unknown memory unit {m['unit']!r} in {part!r} (use GB, GiB, MiB)")
    count = int(m["count"]) if m["count"] is not None else 1
    mem = round(float(m["mem"]) * factor)
    return _checked(where, m["model"], mem, count, _vendor_of(where, m["vendor"], m["model"]))


def _vendor_of(where: str, given: str | None, model: str) -> str:
    """The vendor written, else the catalog's for a model it knows, else nvidia."""
    known = known_model(model)
    if given is None:
        return known.vendor if known else "nvidia"
    if known is not None and given.lower() != known.vendor:
        raise InvalidInput(where, f"{known.name} is made by {known.vendor}, not {given.lower()}")
    return given.lower()


def _check_total(where: str, specs: list[SimDeviceSpec]) -> None:
    total = sum(s.count * max(1, len(s.mig)) for s in specs)
    if total > MAX_DEVICES_PER_NODE:
        raise InvalidInput(where, f"{total} devices is more than a node holds ({MAX_DEVICES_PER_NODE})")


def _checked(where: str, model: object, mem: object, count: object, vendor: object) -> SimDeviceSpec:
    if not isinstance(model, str) or not _MODEL.match(model):
        raise InvalidInput(where, f"bad model name {model!r}")
    if isinstance(mem, bool) or not isinstance(mem, int) or mem <= 0:
        raise InvalidInput(where, f"memory must be a positive number of MiB, got {mem!r}")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_DEVICES_PER_NODE:
        raise InvalidInput(where, f"count must be between 1 and {MAX_DEVICES_PER_NODE}, got {count!r}")
    if not isinstance(vendor, str) or not vendor:
        raise InvalidInput(where, f"bad vendor {vendor!r}")
    return SimDeviceSpec(model=model, memory_mib=mem, count=count, vendor=vendor)


def _parse_json(path: Path) -> list[SimDeviceSpec]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidInput(str(path), "device spec file not found") from None
    except (OSError, ValueError) as e:
        raise InvalidInput(str(path), f"cannot read device spec: {e}") from None
    if not isinstance(data, list) or not data:
        raise InvalidInput(str(path), "expected a non-empty list of {model, memory_mib, count?}")
    out = []
    for i, item in enumerate(data):
        where = f"{path}[{i}]"
        if not isinstance(item, dict):
            raise InvalidInput(where, "expected an object {model, memory_mib, count?}")
        unknown = set(item) - _JSON_FIELDS
        if unknown:
            raise InvalidInput(where, f"unknown field(s) {sorted(unknown)}")
        model = item.get("model")
        known = known_model(model) if isinstance(model, str) else None
        vendor = item.get("vendor")
        if isinstance(model, str) and (vendor is None or isinstance(vendor, str)):
            vendor = _vendor_of(where, vendor, model)
        s = _checked(
            where,
            model,
            item.get("memory_mib", known.memory_mib if known else None),
            item.get("count", 1),
            vendor,
        )
        numa = item.get("numa_node", -1)
        if isinstance(numa, bool) or not isinstance(numa, int):
            raise InvalidInput(where, f"numa_node must be a whole number, got {numa!r}")
        mig = item.get("mig", [])
        if not isinstance(mig, list) or not all(isinstance(x, str) for x in mig):
            raise InvalidInput(where, f"mig must be a list of MIG profiles, got {mig!r}")
        if mig and s.vendor != "nvidia":
            raise InvalidInput(where, f"mig splits NVIDIA GPUs only, not {s.vendor} devices")
        out.append(
            SimDeviceSpec(
                s.model, s.memory_mib, s.count, s.vendor,
                str(item.get("compute_capability", "")), numa, str(item.get("link_group", "")),
                parse_mig(where, "+".join(mig), s.memory_mib) if mig else (),
            )
        )  # fmt: skip
    _check_total(str(path), out)
    return out


@dataclass(frozen=True)
class _Attached:
    pid: int
    device_index: int
    memory_mib: int
    compute_milli: int
    create_time: float
    memory_file: Path | None


class SimulatedBackend:
    """Devices from a spec; usage follows the processes the agent attached to them."""

    name = "simulated"
    reason = ""

    def __init__(
        self, spec: str, seed: str | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.spec = spec
        specs = parse_spec(spec)
        seed = socket.gethostname() if seed is None else seed
        devices: list[DeviceInfo] = []
        gpus = 0
        per_vendor: dict[str, int] = {}  # each vendor numbers its own devices from 0, as drivers do
        for s in specs:
            for _ in range(s.count):
                gpu = DeviceInfo(
                    index=len(devices),
                    vendor=s.vendor,
                    model=s.model,
                    memory_mib=s.memory_mib,
                    uuid=_sim_uuid(seed, gpus, s.model, s.vendor),
                    physical_index=per_vendor.get(s.vendor, 0),
                    compute_capability=s.compute_capability,
                    numa_node=s.numa_node,
                    link_group=s.link_group,
                )
                gpus += 1
                per_vendor[s.vendor] = per_vendor.get(s.vendor, 0) + 1
                if not s.mig:
                    devices.append(gpu)
                for k, profile in enumerate(s.mig):
                    devices.append(_mig_instance(gpu, len(devices), k, profile))
        if len(devices) > MAX_DEVICES_PER_NODE:
            raise InvalidInput("simulate", f"{len(devices)} devices is more than a node holds")
        self._devices = devices
        self._attached: list[_Attached] = []
        self._lock = threading.Lock()
        # per device: its power model (None for a MIG instance), the draw since `_ticked`, and
        # the energy counter (J) booked up to `_ticked`
        self._power: list[PowerModel | None] = [None if d.is_mig else model_power(d.model) for d in devices]
        self._watts = [p.watts(0.0) if p else 0.0 for p in self._power]
        self._energy_j = [0.0] * len(devices)
        self._clock = clock
        self._ticked = clock()
        self._health: dict[int, str] = {}

    def available(self) -> bool:
        return True

    def discover(self) -> list[DeviceInfo]:
        return list(self._devices)

    def attach(
        self,
        pid: int,
        device_index: int,
        memory_mib: int,
        compute_milli: int = MILLI_PER_DEVICE,
        memory_file: Path | None = None,
    ) -> None:
        """Say that `pid` runs on a device holding `memory_mib` (or what `memory_file` says, once written)."""
        if not 0 <= device_index < len(self._devices):
            raise InvalidInput(
                "device_index", f"no simulated device {device_index} ({len(self._devices)} exist)"
            )
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            return  # already gone: nothing to show
        with self._lock:
            self._advance()
            self._attached = [a for a in self._attached if (a.pid, a.device_index) != (pid, device_index)]
            entry = _Attached(pid, device_index, memory_mib, compute_milli, created, memory_file)
            self._attached.append(entry)
            self._advance()

    def detach(self, pid: int) -> None:
        with self._lock:
            self._advance()
            self._attached = [a for a in self._attached if a.pid != pid]
            self._advance()

    def set_health(self, device_index: int, why: str) -> None:
        """Make a device report itself unhealthy (`why`), or healthy again with "" (demos, tests)."""
        if not 0 <= device_index < len(self._devices):
            raise InvalidInput(
                "device_index", f"no simulated device {device_index} ({len(self._devices)} exist)"
            )
        with self._lock:
            if why:
                self._health[device_index] = why
            else:
                self._health.pop(device_index, None)

    def attached_pids(self) -> set[int]:
        with self._lock:
            self._prune()
            return {a.pid for a in self._attached}

    def _prune(self) -> None:
        alive = [a for a in self._attached if _alive(a.pid, a.create_time)]
        if len(alive) != len(self._attached):
            self._advance()  # the draw until now was the busier one
            self._attached = alive
            self._advance()

    def _utilization(self) -> list[float]:
        """Per device: the compute its attached processes were given, as a share of the device."""
        milli = [0] * len(self._devices)
        for a in self._attached:
            milli[a.device_index] += a.compute_milli
        return [min(100.0, m * 100.0 / MILLI_PER_DEVICE) for m in milli]

    def _advance(self) -> None:
        """Book each GPU's draw since the last tick into its energy counter, then take the draw
        the current utilization gives. Called with the lock held."""
        now = self._clock()
        dt = max(0.0, now - self._ticked)
        self._ticked = now
        for i, (model, util) in enumerate(zip(self._power, self._utilization(), strict=True)):
            if model is not None:
                self._energy_j[i] += self._watts[i] * dt
                self._watts[i] = model.watts(util)

    def usage(self) -> list[DeviceUsage]:
        with self._lock:
            self._prune()
            self._advance()
            attached = list(self._attached)
            util = self._utilization()
            energy = list(self._energy_j)
            watts = list(self._watts)
            health = dict(self._health)
        out = []
        for d in self._devices:
            procs: dict[int, int] = {}
            for a in attached:
                if a.device_index == d.index:
                    procs[a.pid] = procs.get(a.pid, 0) + _reported(a)
            whole = self._power[d.index] is not None
            out.append(
                DeviceUsage(
                    d.index,
                    d.uuid,
                    util[d.index],
                    sum(procs.values()),
                    procs,
                    power_w=watts[d.index] if whole else None,
                    energy_j=energy[d.index] if whole else None,
                    health=health.get(d.index, ""),
                )
            )
        return out


def _mig_instance(gpu: DeviceInfo, index: int, k: int, profile: str) -> DeviceInfo:
    """Instance `k` of a simulated GPU, named as NVML names one (`<model> MIG <profile>`)."""
    m = MIG_PROFILE.match(profile)
    assert m is not None  # checked by parse_mig
    return replace(
        gpu,
        index=index,
        model=f"{gpu.model}-MIG-{profile.replace('+', '-')}",
        memory_mib=int(m["gb"]) * 1024,
        uuid=f"MIG-{uuidlib.uuid5(uuidlib.NAMESPACE_URL, f'computepool-sim-mig:{gpu.uuid}:{k}:{profile}')}",
        compute_milli=round(MILLI_PER_DEVICE * int(m["slices"]) / MIG_SLICES),
        mig_parent_uuid=gpu.uuid,
    )


def _sim_uuid(seed: str, index: int, model: str, vendor: str = "nvidia") -> str:
    """Stable across agent restarts, distinct across simulated nodes (seeded by node name). NVIDIA's
    look like NVML's (`GPU-…`); other vendors' say whose they are and that they are simulated."""
    u = uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"computepool-sim:{seed}:{index}:{model}")
    return f"GPU-{u}" if vendor == "nvidia" else f"{vendor}-sim-{u}"


def _alive(pid: int, create_time: float) -> bool:
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) < 0.05 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reported(a: _Attached) -> int:
    """What the workload says it uses (the memory file), else what the agent attached."""
    if a.memory_file is None:
        return a.memory_mib
    try:
        # the job writes this file: never follow its links, never wait on a FIFO, read a few bytes
        fd = os.open(a.memory_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return a.memory_mib
            return max(0, round(float(os.read(fd, 64).decode().strip())))
        finally:
            os.close(fd)
    except (OSError, ValueError, UnicodeDecodeError, OverflowError):
        return a.memory_mib
