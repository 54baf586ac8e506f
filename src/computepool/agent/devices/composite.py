"""One node's devices from several vendors' backends: numbered one after the other, and their
usage asked of each backend and renumbered the same way."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from computepool.agent.devices.base import DeviceBackend, DeviceInfo, DeviceUsage


class CompositeBackend:
    """The devices of `backends`, in that order: the node's index of a backend's device i is i
    plus the count of the backends before it (vendor indices stay as each backend found them)."""

    name = "composite"
    reason = ""

    def __init__(self, backends: Sequence[DeviceBackend]) -> None:
        self.backends = list(backends)
        self._parts: list[tuple[DeviceBackend, int, list[DeviceInfo]]] = []
        devices: list[DeviceInfo] = []
        for b in self.backends:
            found = b.discover()
            self._parts.append((b, len(devices), found))
            devices += [replace(d, index=len(devices) + i) for i, d in enumerate(found)]
        self._devices = devices

    def available(self) -> bool:
        return bool(self._devices)

    def discover(self) -> list[DeviceInfo]:
        return list(self._devices)

    def usage(self) -> list[DeviceUsage]:
        out: list[DeviceUsage] = []
        for b, first, found in self._parts:
            known = {d.index for d in found}
            out += [replace(u, index=first + u.index) for u in b.usage() if u.index in known]
        return out
