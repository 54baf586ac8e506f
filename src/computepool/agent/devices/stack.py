"""The software stacks a node provides for its devices, as node labels (`stack.cuda=12.4`).

A job built for CUDA 12.4 needs a driver that supports 12.4 or later; one built for ROCm 6.2 needs
ROCm 6.2. The agent labels what it finds when it joins (labels the operator gave win), and a
request asks with `--stack cuda-12.4`: the scheduler keeps it to nodes labelled that version or
later (scheduler/constraints.py). Each probe reads what the vendor's runtime itself reports and
says nothing where it finds nothing:

- NVIDIA: the CUDA version the driver supports (NVML's `nvmlSystemGetCudaDriverVersion_v2`);
- AMD: the installed ROCm release (`$ROCM_PATH/.info/version`, default /opt/rocm);
- Huawei Ascend: the installed CANN toolkit (`ascend_toolkit_install.info`'s `version=`);
- Apple: the macOS release (Metal's features follow it).

Intel's Level Zero reports no release a job could ask for in one place: no label (say one with
`cpool agent --label stack.oneapi=2025.0`).
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
from collections.abc import Iterable
from pathlib import Path

from computepool.agent.devices.base import DeviceInfo

PREFIX = "stack."
_RELEASE = re.compile(r"^\s*([0-9]+(?:\.[0-9A-Za-z]+){0,3})")


def stack_labels(devices: Iterable[DeviceInfo], root: Path = Path("/")) -> dict[str, str]:
    """Labels naming the stacks found for the vendors of `devices` (simulated ones have none)."""
    vendors = {d.vendor for d in devices}
    found: dict[str, str | None] = {}
    if "nvidia" in vendors:
        found["cuda"] = cuda_driver_version()
    if "amd" in vendors:
        found["rocm"] = rocm_version(root)
    if "ascend" in vendors:
        found["cann"] = cann_version(root)
    if "apple" in vendors and platform.system() == "Darwin":
        found["macos"] = release(platform.mac_ver()[0])
    return {PREFIX + name: v for name, v in found.items() if v}


def release(text: str) -> str | None:
    """The leading `12.4` or `8.0.RC2` of a version string (build suffixes dropped)."""
    m = _RELEASE.match(text)
    return m.group(1) if m else None


def cuda_driver_version() -> str | None:
    """`12.4` for a driver whose NVML reports 12040; None without NVML."""
    try:
        import pynvml  # noqa: PLC0415 - only nodes with NVIDIA devices ask

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - a missing library or driver: no label
        return None
    try:
        v = int(pynvml.nvmlSystemGetCudaDriverVersion_v2())
    except Exception:  # noqa: BLE001
        return None
    finally:
        with contextlib.suppress(Exception):  # shutting down what was opened: nothing to say
            pynvml.nvmlShutdown()
    return f"{v // 1000}.{(v % 1000) // 10}" if v > 0 else None


def rocm_version(root: Path) -> str | None:
    """The ROCm release in `$ROCM_PATH/.info/version` (`6.2.0-66` → `6.2.0`)."""
    base = os.environ.get("ROCM_PATH", "/opt/rocm").lstrip("/")
    try:
        return release((root / base / ".info" / "version").read_text())
    except OSError:
        return None


def cann_version(root: Path) -> str | None:
    """The CANN toolkit's `version=8.0.RC2` from its install info, where the toolkit lives."""
    toolkit = root / "usr/local/Ascend/ascend-toolkit/latest"
    for info in sorted(toolkit.glob("*/ascend_toolkit_install.info")) + [
        toolkit / "ascend_toolkit_install.info"
    ]:
        try:
            text = info.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "version":
                return release(value.strip())
    return None
