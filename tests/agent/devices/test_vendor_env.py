"""What a job is given by its devices' vendor: the visible-devices variables, the container's
device nodes (found under a device tree of the test's own), and the simulated catalog that lets
a node pretend to be any vendor's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from computepool.agent.container import Podman
from computepool.agent.devices import DeviceInfo, SimulatedBackend, parse_spec
from computepool.agent.devices.nodes import amd_nodes, ascend_nodes, intel_nodes
from computepool.agent.isolation import SliceAssignment, slice_env
from computepool.core import InvalidInput, Isolation
from computepool.core.power import DEFAULT, model_power

NV = DeviceInfo(0, "nvidia", "A100", 81920, "GPU-aaaa", physical_index=0)
AMD = DeviceInfo(1, "amd", "MI300X", 196608, "amd-uuid-1", physical_index=3)
AMD2 = DeviceInfo(2, "amd", "MI300X", 196608, "amd-uuid-2", physical_index=5)
INTEL = DeviceInfo(3, "intel", "Max-1550", 131072, "intel-uuid", physical_index=1)
NPU = DeviceInfo(4, "ascend", "Ascend910B3", 65536, "ascend-0000:c1:00.0", physical_index=6)
MAC = DeviceInfo(5, "apple", "M2-Ultra", 196608, "apple-host-0", physical_index=0)
VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")
VARS += ("ASCEND_RT_VISIBLE_DEVICES",)


def env_of(tmp_path: Path, *devices: DeviceInfo) -> dict[str, str]:
    slices = [SliceAssignment(d, 1000, d.memory_mib, Isolation.EXCLUSIVE) for d in devices]
    return slice_env("a1", 1, slices, tmp_path, user_env={"HIP_VISIBLE_DEVICES": "0,1,2,3"})


@pytest.mark.parametrize(
    ("devices", "want"),
    [
        ((NV,), {"CUDA_VISIBLE_DEVICES": "GPU-aaaa"}),
        ((AMD, AMD2), {"HIP_VISIBLE_DEVICES": "3,5", "ROCR_VISIBLE_DEVICES": "3,5"}),
        ((INTEL,), {"ZE_AFFINITY_MASK": "1"}),
        ((NPU,), {"ASCEND_RT_VISIBLE_DEVICES": "6"}),
        ((MAC,), {}),
        ((), {}),
    ],
)
def test_each_vendor_names_its_devices_and_every_other_vendor_none(
    tmp_path: Path, devices: tuple[DeviceInfo, ...], want: dict[str, str]
) -> None:
    env = env_of(tmp_path, *devices)
    assert {k: env[k] for k in VARS} == {k: want.get(k, "") for k in VARS}  # the user's HIP list is gone
    assert env["CPOOL_DEVICE_UUIDS"] == ",".join(d.uuid for d in devices)


def test_a_job_over_two_vendors_sees_both(tmp_path: Path) -> None:
    env = env_of(tmp_path, NV, NPU)
    assert (env["CUDA_VISIBLE_DEVICES"], env["ASCEND_RT_VISIBLE_DEVICES"], env["HIP_VISIBLE_DEVICES"]) == (
        "GPU-aaaa",
        "6",
        "",
    )


def _dev_tree(root: Path) -> Path:
    """A /dev of the test's own: AMD's kfd and render nodes with udev's by-path links, an Intel
    GPU's card and render nodes, and an Ascend NPU's davinci nodes (no devmm_svm)."""
    dri = root / "dri"
    (dri / "by-path").mkdir(parents=True)
    for n in (
        "kfd",
        "davinci0",
        "davinci_manager",
        "hisi_hdc",
        "dri/renderD128",
        "dri/renderD129",
        "dri/card1",
    ):
        (root / n).touch()
    (dri / "by-path" / "pci-0000:0c:00.0-render").symlink_to("../renderD128")
    (dri / "by-path" / "pci-0000:4d:00.0-render").symlink_to("../renderD129")
    (dri / "by-path" / "pci-0000:4d:00.0-card").symlink_to("../card1")
    return root


def test_vendor_device_nodes_are_those_that_exist(tmp_path: Path) -> None:
    dev = _dev_tree(tmp_path / "dev")
    assert amd_nodes("0000:0C:00.0", dev=dev) == (str(dev / "kfd"), str(dev / "dri/renderD128"))
    assert amd_nodes("", render_minor=129, dev=dev) == (str(dev / "kfd"), str(dev / "dri/renderD129"))
    assert intel_nodes("0000:4d:00.0", dev=dev) == (str(dev / "dri/renderD129"), str(dev / "dri/card1"))
    assert ascend_nodes(0, dev=dev) == tuple(
        str(dev / n) for n in ("davinci0", "davinci_manager", "hisi_hdc")
    )
    assert ascend_nodes(1, dev=dev) == (str(dev / "davinci_manager"), str(dev / "hisi_hdc"))
    assert intel_nodes("0000:99:00.0", dev=dev) == ()


def test_container_gets_the_slices_nodes_and_simulated_devices_none(tmp_path: Path) -> None:
    dev = _dev_tree(tmp_path / "dev")
    p = Podman(tmp_path / "agent", cdi_dirs=(tmp_path / "no-cdi",))
    nodes = amd_nodes("0000:0c:00.0", dev=dev) + ascend_nodes(0, dev=dev)
    os.remove(dev / "hisi_hdc")  # gone since discovery: left out
    assert p.device_args(("amd-uuid", "ascend-0000:c1:00.0"), nodes) == [
        f"--device={dev / n}" for n in ("kfd", "dri/renderD128", "davinci0", "davinci_manager")
    ]
    sim = SimulatedBackend("1xMI300X,1xAscend910B,1xM2-Ultra", seed="n")
    devs = sim.discover()
    assert all(d.dev_nodes == () and not d.uuid.startswith(("GPU-", "MIG-")) for d in devs)
    assert p.device_args(tuple(d.uuid for d in devs), ()) == []


def test_simulated_catalog_models_take_their_vendor_and_memory() -> None:
    got = [(s.vendor, s.model, s.memory_mib, s.count) for s in parse_spec("2xMI300X,4xAscend910B,1xM2-Ultra")]
    assert got == [
        ("amd", "MI300X", 196608, 2),
        ("ascend", "Ascend910B", 65536, 4),
        ("apple", "M2-Ultra", 196608, 1),
    ]
    more = "MI250X,mi210,Ascend310P,Max-1550,Arc-A770,M3-Max,apple/M2-Ultra-64GB,MI300X-96GB,amd/MI300X-192GB"
    got = [(s.vendor, s.model, s.memory_mib) for s in parse_spec(more)]
    assert got == [
        ("amd", "MI250X", 131072),
        ("amd", "MI210", 65536),
        ("ascend", "Ascend310P", 24576),
        ("intel", "Max-1550", 131072),
        ("intel", "Arc-A770", 16384),
        ("apple", "M3-Max", 131072),
        ("apple", "M2-Ultra", 65536),
        ("amd", "MI300X", 98304),
        ("amd", "MI300X", 196608),
    ]
    assert [(s.vendor, s.model) for s in parse_spec("1xA100-80GB,T4-16GB")] == [
        ("nvidia", "A100"),
        ("nvidia", "T4"),
    ]


def test_simulated_devices_of_each_vendor_number_from_zero(tmp_path: Path) -> None:
    devs = SimulatedBackend("2xMI300X,1xA100-80GB,2xAscend910B", seed="n").discover()
    assert [(d.index, d.vendor, d.physical_index) for d in devs] == [
        (0, "amd", 0),
        (1, "amd", 1),
        (2, "nvidia", 0),
        (3, "ascend", 0),
        (4, "ascend", 1),
    ]
    assert [d.uuid.split("-sim-")[0] for d in devs if d.vendor != "nvidia"] == [
        "amd",
        "amd",
        "ascend",
        "ascend",
    ]
    assert devs[2].uuid.startswith("GPU-")
    env = env_of(tmp_path, devs[4])
    assert (env["ASCEND_RT_VISIBLE_DEVICES"], env["CUDA_VISIBLE_DEVICES"]) == ("1", "")


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("2xFOO", "unknown model 'FOO' in '2xFOO': give its memory (like 2xFOO-80GB)"),
        ("1xA100", "unknown model 'A100' in '1xA100'"),
        ("nvidia/MI300X", "MI300X is made by amd, not nvidia"),
        ("MI300X:mig=1g.10gb", "mig= splits NVIDIA GPUs only, not amd devices"),
        ("2xMI300X!", "cannot read '2xMI300X!'"),
    ],
)
def test_bad_catalog_entries_name_the_entry(spec: str, words: str) -> None:
    with pytest.raises(InvalidInput) as e:
        parse_spec(spec)
    assert words in str(e.value)


def test_json_spec_may_name_a_catalog_model_alone(tmp_path: Path) -> None:
    f = tmp_path / "devices.json"
    f.write_text(json.dumps([{"model": "Ascend910B", "count": 2}, {"model": "MI210", "memory_mib": 32768}]))
    assert [(s.vendor, s.model, s.memory_mib, s.count) for s in parse_spec(str(f))] == [
        ("ascend", "Ascend910B", 65536, 2),
        ("amd", "MI210", 32768, 1),
    ]


def test_power_models_of_other_vendors_name_their_source() -> None:
    assert (
        model_power("MI300X").peak_w,
        model_power("Max-1550").peak_w,
        model_power("Ascend310P3").peak_w,
    ) == (
        750.0,
        600.0,
        72.0,
    )
    assert "AMD" in model_power("MI250X").source and "Intel" in model_power("Arc-A770").source
    assert model_power("M2-Ultra") is DEFAULT and model_power("Ascend910B3") is DEFAULT  # no published figure
