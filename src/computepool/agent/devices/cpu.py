"""Host CPU and memory: what the node can give to workloads, honouring a cgroup quota around us."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

MIB = 1024 * 1024


@dataclass(frozen=True)
class CpuInventory:
    """Cores (millicores) and host memory this agent may hand out."""

    cpu_milli: int
    memory_mib: int
    logical_cpus: int
    model: str = ""
    numa_nodes: int = 1


@dataclass(frozen=True)
class CpuUsage:
    cpu_pct: float
    memory_used_mib: int
    memory_available_mib: int


def _cgroup_cpu_limit() -> float | None:
    """Cores allowed by our own cgroup v2 `cpu.max`, if any (in a container, say)."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _cgroup_memory_limit() -> int | None:
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        return None if text == "max" else int(text) // MIB
    except (OSError, ValueError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _numa_nodes() -> int:
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return max(1, len(nodes))


def cpu_inventory() -> CpuInventory:
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (psutil.cpu_count() or 1)
    cores: float = logical
    quota = _cgroup_cpu_limit()
    if quota is not None:
        cores = min(cores, quota)
    memory = psutil.virtual_memory().total // MIB
    mem_limit = _cgroup_memory_limit()
    if mem_limit is not None:
        memory = min(memory, mem_limit)
    return CpuInventory(
        cpu_milli=math.floor(cores * 1000),
        memory_mib=int(memory),
        logical_cpus=logical,
        model=_cpu_model(),
        numa_nodes=_numa_nodes(),
    )


def cpu_usage() -> CpuUsage:
    vm = psutil.virtual_memory()
    return CpuUsage(
        cpu_pct=psutil.cpu_percent(interval=None),
        memory_used_mib=int((vm.total - vm.available) // MIB),
        memory_available_mib=int(vm.available // MIB),
    )
