"""Apple silicon GPUs on macOS, through `system_profiler SPDisplaysDataType -json` and `sysctl`.

system_profiler names each GPU (`sppci_model`: `Apple M2 Ultra`) and its core count
(`sppci_cores`); an Apple GPU has no memory of its own but shares the machine's unified memory,
which `sysctl -n hw.memsize` gives (bytes): that is the device's memory here. GPUs of other
vendors in an Intel Mac are left out (no runtime of the pool's drives them there). The uuid is
the host's (`sysctl -n kern.uuid`) with the GPU's position. macOS shows a GPU's load only to
root through `powermetrics`, so usage reports no utilization, memory or power; there is no
visible-devices variable, and a job on the node sees its GPU.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from computepool.agent.devices.base import DeviceInfo, DeviceUsage
from computepool.agent.devices.tools import ToolError, model_name, number, run_tool

MIB = 1024 * 1024


@dataclass(frozen=True)
class AppleGpu:
    model: str
    cores: int | None
    metal: str


def normalize_model(name: str) -> str:
    """`Apple M2 Ultra` → `M2-Ultra`."""
    words = name.split()
    if words and words[0] == "Apple":
        words = words[1:]
    return model_name(words, "Apple-GPU")


def parse_displays(text: str) -> list[AppleGpu]:
    """Apple's GPUs in `system_profiler SPDisplaysDataType -json`."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ToolError(f"system_profiler printed no JSON ({e})") from None
    items = data.get("SPDisplaysDataType") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise ToolError("system_profiler printed no SPDisplaysDataType")
    out = []
    for item in items:
        if not isinstance(item, dict) or item.get("spdisplays_vendor") != "sppci_vendor_Apple":
            continue
        cores = number(item.get("sppci_cores"))
        out.append(
            AppleGpu(
                normalize_model(str(item.get("sppci_model") or item.get("_name") or "")),
                int(cores) if cores is not None else None,
                str(item.get("spdisplays_mtlgpufamilysupport", "")).removeprefix("spdisplays_"),
            )
        )
    return out


def parse_sysctl(text: str) -> tuple[int, str]:
    """`sysctl -n hw.memsize kern.uuid` → (memory in MiB, host uuid)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    size = number(lines[0]) if lines else None
    if size is None:
        raise ToolError(f"sysctl hw.memsize printed {lines[0] if lines else 'nothing'!r}")
    return int(size // MIB), (lines[1] if len(lines) > 1 else "")


class AppleBackend:
    """Apple GPUs on this Mac. The tools and the platform are parameters so that the parsing can
    be exercised off macOS."""

    name = "apple"

    def __init__(
        self, profiler: str = "system_profiler", sysctl: str = "sysctl", platform: str = sys.platform
    ) -> None:
        self.profiler, self.sysctl, self.platform = profiler, sysctl, platform
        self._tried = False
        self._reason = ""
        self._devices: list[DeviceInfo] = []

    @property
    def reason(self) -> str:
        self._init()
        return self._reason

    def _init(self) -> None:
        if self._tried:
            return
        self._tried = True
        if self.platform != "darwin":
            self._reason = f"Apple GPUs unavailable: not macOS (platform {self.platform})"
            return
        try:
            gpus = parse_displays(run_tool([self.profiler, "SPDisplaysDataType", "-json"], timeout_s=30))
            memory, host = parse_sysctl(run_tool([self.sysctl, "-n", "hw.memsize", "kern.uuid"]))
        except ToolError as e:
            self._reason = f"Apple GPUs unavailable: {e}"
            return
        if not gpus:
            self._reason = "Apple GPUs unavailable: system_profiler lists no Apple GPU"
        self._devices = [
            DeviceInfo(
                index=i,
                vendor="apple",
                model=g.model,
                memory_mib=memory,
                uuid=f"apple-{host or 'mac'}-{i}",
                physical_index=i,
                compute_capability=g.metal,
                cores=g.cores or 0,
            )
            for i, g in enumerate(gpus)
        ]

    def available(self) -> bool:
        self._init()
        return bool(self._devices)

    def discover(self) -> list[DeviceInfo]:
        self._init()
        return list(self._devices)

    def usage(self) -> list[DeviceUsage]:
        return [DeviceUsage(d.index, d.uuid, None, 0) for d in self._devices]
