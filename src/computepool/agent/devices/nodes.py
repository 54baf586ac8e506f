"""The device files a container needs for one accelerator, by vendor, as they exist under `dev`
(a parameter, so tests can lay out a device tree of their own).

- AMD: `/dev/kfd` (the compute driver, shared) and the GPU's DRM render node.
- Intel: the GPU's DRM render node and card node.
- Ascend: `/dev/davinciN` for the NPU, and the shared `davinci_manager`, `devmm_svm`, `hisi_hdc`.

A GPU's DRM nodes are found by its PCI address through `dri/by-path` (udev's stable names), or
from the render minor the vendor library reports. Only nodes that exist are returned.
"""

from __future__ import annotations

from pathlib import Path

DEV = Path("/dev")
ASCEND_SHARED = ("davinci_manager", "devmm_svm", "hisi_hdc")


def _existing(paths: list[Path]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(str(p) for p in paths if p.exists()))


def drm_nodes(
    bus_id: str, dev: Path = DEV, render_minor: int | None = None, card: bool = False
) -> list[Path]:
    """The render node (and the card node when `card`) of the GPU at PCI address `bus_id`."""
    found: list[Path] = []
    by_path = dev / "dri" / "by-path"
    if bus_id:
        kinds = ("render", "card") if card else ("render",)
        for kind in kinds:
            link = by_path / f"pci-{bus_id.lower()}-{kind}"
            if link.exists():
                found.append(dev / "dri" / link.resolve().name)  # renderD128, card0
    if not found and render_minor is not None and render_minor >= 128:
        found.append(dev / "dri" / f"renderD{render_minor}")
    return found


def amd_nodes(bus_id: str, render_minor: int | None = None, dev: Path = DEV) -> tuple[str, ...]:
    return _existing([dev / "kfd", *drm_nodes(bus_id, dev, render_minor)])


def intel_nodes(bus_id: str, dev: Path = DEV) -> tuple[str, ...]:
    return _existing(drm_nodes(bus_id, dev, card=True))


def ascend_nodes(device_index: int, dev: Path = DEV) -> tuple[str, ...]:
    return _existing([dev / f"davinci{device_index}", *(dev / n for n in ASCEND_SHARED)])
