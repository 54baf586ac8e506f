"""Simulated devices for machines without accelerators (tests, demos) that behave like real ones.

The agent tells the backend which process runs on which device (`attach`/`detach`), as the
driver would see it; processes that exit are dropped on their own. A workload can also claim to
use some GPU memory by writing a number of MiB into the file named by `CPOOL_SIM_MEMORY_FILE`,
so the memory watchdog can be exercised without a GPU.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path

import psutil

from computepool.agent.devices.base import DeviceInfo, DeviceUsage
from computepool.core.errors import InvalidInput
from computepool.core.quantities import MILLI_PER_DEVICE
from computepool.core.request import MAX_DEVICES_PER_NODE

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


def parse_spec(spec: str) -> list[SimDeviceSpec]:
    """`2xA100-80GB,1xT4-16GB` (optionally `vendor/MODEL-MEM`) or the path of a JSON file."""
    text = spec.strip()
    if not text:
        raise InvalidInput("simulate", "empty device spec (expected e.g. 2xA100-80GB,1xT4-16GB)")
    if text.endswith(".json") or Path(text).is_file():
        return _parse_json(Path(text))
    out = []
    for part in text.split(","):
        part = part.strip()
        m = _ENTRY.match(part)
        if not m:
            raise InvalidInput(
                "simulate", f"cannot read {part!r} in {spec!r} (expected COUNTxMODEL-MEMORY like 2xA100-80GB)"
            )
        factor = _UNIT_MIB.get(m["unit"].lower())
        if factor is None:
            raise InvalidInput(
                "simulate", f"unknown memory unit {m['unit']!r} in {part!r} (use GB, GiB, MiB)"
            )
        count = int(m["count"]) if m["count"] is not None else 1
        mem = round(float(m["mem"]) * factor)
        out.append(_checked(f"simulate: {part!r}", m["model"], mem, count, (m["vendor"] or "nvidia").lower()))
    return out


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
        s = _checked(
            where,
            item.get("model"),
            item.get("memory_mib"),
            item.get("count", 1),
            item.get("vendor", "nvidia"),
        )
        numa = item.get("numa_node", -1)
        if isinstance(numa, bool) or not isinstance(numa, int):
            raise InvalidInput(where, f"numa_node must be a whole number, got {numa!r}")
        out.append(
            SimDeviceSpec(
                s.model, s.memory_mib, s.count, s.vendor,
                str(item.get("compute_capability", "")), numa, str(item.get("link_group", "")),
            )
        )  # fmt: skip
    total = sum(s.count for s in out)
    if total > MAX_DEVICES_PER_NODE:
        raise InvalidInput(str(path), f"{total} devices is more than a node holds ({MAX_DEVICES_PER_NODE})")
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

    def __init__(self, spec: str, seed: str | None = None) -> None:
        self.spec = spec
        specs = parse_spec(spec)
        seed = socket.gethostname() if seed is None else seed
        devices: list[DeviceInfo] = []
        for s in specs:
            for _ in range(s.count):
                i = len(devices)
                devices.append(
                    DeviceInfo(
                        index=i,
                        vendor=s.vendor,
                        model=s.model,
                        memory_mib=s.memory_mib,
                        uuid=_sim_uuid(seed, i, s.model),
                        physical_index=i,
                        compute_capability=s.compute_capability,
                        numa_node=s.numa_node,
                        link_group=s.link_group,
                    )
                )
        if len(devices) > MAX_DEVICES_PER_NODE:
            raise InvalidInput("simulate", f"{len(devices)} devices is more than a node holds")
        self._devices = devices
        self._attached: list[_Attached] = []
        self._lock = threading.Lock()

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
            self._attached = [a for a in self._attached if (a.pid, a.device_index) != (pid, device_index)]
            entry = _Attached(pid, device_index, memory_mib, compute_milli, created, memory_file)
            self._attached.append(entry)

    def detach(self, pid: int) -> None:
        with self._lock:
            self._attached = [a for a in self._attached if a.pid != pid]

    def attached_pids(self) -> set[int]:
        with self._lock:
            self._prune()
            return {a.pid for a in self._attached}

    def _prune(self) -> None:
        self._attached = [a for a in self._attached if _alive(a.pid, a.create_time)]

    def usage(self) -> list[DeviceUsage]:
        with self._lock:
            self._prune()
            attached = list(self._attached)
        out = []
        for d in self._devices:
            procs: dict[int, int] = {}
            milli = 0
            for a in attached:
                if a.device_index == d.index:
                    procs[a.pid] = procs.get(a.pid, 0) + _reported(a)
                    milli += a.compute_milli
            util = min(100.0, milli * 100.0 / MILLI_PER_DEVICE)
            out.append(DeviceUsage(d.index, d.uuid, util, sum(procs.values()), procs))
        return out


def _sim_uuid(seed: str, index: int, model: str) -> str:
    """Stable across agent restarts, distinct across simulated nodes (seeded by node name)."""
    return f"GPU-{uuidlib.uuid5(uuidlib.NAMESPACE_URL, f'computepool-sim:{seed}:{index}:{model}')}"


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
        return max(0, round(float(a.memory_file.read_text().strip())))
    except (OSError, ValueError):
        return a.memory_mib
