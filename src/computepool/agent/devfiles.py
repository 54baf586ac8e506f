"""Which accelerator device files a process job must not open: every device's but its slice's.

The drivers make their device files open to every user (`/dev/nvidia1` 0666, a DRM render node,
an NPU's `davinciN`; MIG capability files 0444): `CUDA_VISIBLE_DEVICES` and its kin only ask a
runtime to look away. So a process job gets, in its own mount namespace, an inaccessible file bound
over each such file of the node that its slice does not hold (sandbox.py), the way a device cgroup
would refuse them; the runtimes skip a device they cannot open. A container is given its slice's
files alone (container.py). `dev` and `caps_root` are parameters so tests can lay out a tree.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

DEV = Path("/dev")
NVIDIA_CAPS = Path("/proc/driver/nvidia/capabilities")
NVIDIA_COMMON_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
_CAP_MINOR = re.compile(r"DeviceFileMinor:\s*(\d+)")
# one device each: NVIDIA GPUs, DRM (AMD, Intel) render and card nodes, Ascend NPUs, accel nodes
_PER_DEVICE = ("nvidia[0-9]*", "dri/renderD[0-9]*", "dri/card[0-9]*", "davinci[0-9]*", "accel/accel[0-9]*")
# every device's driver entry points: a job with a slice needs them, a job without one does not
_SHARED = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "kfd", "davinci_manager",
           "devmm_svm", "hisi_hdc")  # fmt: skip
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9/_.-]+$")  # a word of the namespaces' init shell


def mig_cap_nodes(minor: int, gi: int, ci: int, caps_root: Path = NVIDIA_CAPS) -> list[str]:
    """The `/dev/nvidia-caps` nodes that open one MIG instance: its GPU and compute instance's."""
    mig = caps_root / f"gpu{minor}" / "mig" / f"gi{gi}"
    nodes = []
    for access in (mig / "access", mig / f"ci{ci}" / "access"):
        with contextlib.suppress(OSError):
            m = _CAP_MINOR.search(access.read_text())
            if m:
                nodes.append(f"/dev/nvidia-caps/nvidia-cap{m.group(1)}")
    return nodes


def nvidia_nodes(uuid: str) -> list[str]:
    """/dev/nvidiaN of the GPU (a MIG instance's parent) plus, for MIG, its capability nodes."""
    try:
        import pynvml  # noqa: PLC0415 - only nodes with NVIDIA's driver have it
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver: nothing to pass
        return []
    try:
        h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        if not uuid.startswith("MIG-"):
            return [f"/dev/nvidia{pynvml.nvmlDeviceGetMinorNumber(h)}"]
        parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h)
        minor = pynvml.nvmlDeviceGetMinorNumber(parent)
        gi = pynvml.nvmlDeviceGetGpuInstanceId(h)
        ci = pynvml.nvmlDeviceGetComputeInstanceId(h)
        return [f"/dev/nvidia{minor}", *mig_cap_nodes(minor, gi, ci)]
    except Exception:  # an unknown uuid (simulated device) or an old driver: no device node
        return []
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _mig_access_nodes(dev: Path, caps_root: Path) -> list[Path]:
    """Every MIG instance's capability files (not the driver's config and monitor capabilities)."""
    found = []
    for access in [*caps_root.glob("gpu*/mig/gi*/access"), *caps_root.glob("gpu*/mig/gi*/ci*/access")]:
        with contextlib.suppress(OSError):
            m = _CAP_MINOR.search(access.read_text())
            if m:
                found.append(dev / "nvidia-caps" / f"nvidia-cap{m.group(1)}")
    return found


def _is_device(path: Path) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode) or stat.S_ISBLK(os.stat(path).st_mode)
    except OSError:
        return False


def hidden_files(
    uuids: Iterable[str], nodes: Iterable[str], dev: Path = DEV, caps_root: Path = NVIDIA_CAPS
) -> tuple[list[str], str]:
    """The device files of the node a job with these slice devices (`uuids`, and the files their
    backends found, `nodes`) may not open, and why some were left open ("" when none were).

    NVIDIA's are found through NVML by uuid; where a real GPU's files cannot be found, the node's
    NVIDIA files stay open rather than hide the job's own GPU. A job with no device at all also
    loses the drivers' shared entry points (`nvidiactl`, `kfd`, …)."""
    uuids = list(uuids)
    keep = {os.path.normpath(n) for n in nodes}
    why = ""
    for u in uuids:
        if u.startswith(("GPU-", "MIG-")):
            found = [str(dev / Path(p).relative_to(DEV)) for p in nvidia_nodes(u)]
            if not found:
                why = f"the NVIDIA device files stay open: none found for {u}"
            keep.update(found)
    candidates = [p for pattern in _PER_DEVICE for p in dev.glob(pattern)]
    candidates += _mig_access_nodes(dev, caps_root)
    if not uuids:
        candidates += [dev / name for name in _SHARED]
    if why:
        nvidia = [p for p in candidates if p.name.startswith("nvidia")]
        candidates = [p for p in candidates if p not in nvidia]
        if not any(_is_device(p) for p in nvidia):
            why = ""  # no NVIDIA file on the node (a simulated GPU): nothing left open
    hide = sorted({str(p) for p in candidates if str(p) not in keep and _is_device(p)})
    return [p for p in hide if _SAFE_PATH.match(p)], why
