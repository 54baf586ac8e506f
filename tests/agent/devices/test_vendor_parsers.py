"""Each vendor backend's parsing, on the vendor tools' own output formats recorded under data/
(each folder's README names where they come from), and AMD's through its library's answers."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from computepool.agent.devices import AmdBackend, amd, apple, ascend, intel
from computepool.agent.devices.tools import ToolError

DATA = Path(__file__).parent / "data"


def text(vendor: str, name: str) -> str:
    return (DATA / vendor / name).read_text()


# ---- Ascend: npu-smi info ------------------------------------------------------------------------


def test_npu_smi_910b_table_gives_each_chip_its_hbm_power_and_bus() -> None:
    chips = ascend.parse_info(text("ascend", "info-910b3-24.1.txt"))
    got = [
        (c.npu_id, c.chip_id, c.device_id, c.name, c.bus_id, c.memory_used_mib, c.memory_total_mib)
        for c in chips
    ]
    assert len(got) == 8 and got[:3] == [
        (0, 0, None, "910B3", "0000:c1:00.0", 3318, 65536),
        (1, 0, None, "910B3", "0000:c2:00.0", 3314, 65536),
        (2, 0, None, "910B3", "0000:81:00.0", 3314, 65536),
    ]
    assert got[7] == (7, 0, None, "910B3", "0000:42:00.0", 3315, 65536)
    assert [c.power_w for c in chips] == [101.8, 92.0, 102.0, 99.8, 98.6, 99.7, 103.8, 98.2]
    assert {c.health for c in chips} == {"OK"} and {c.aicore_pct for c in chips} == {0.0}
    assert [ascend.device_index(c, i) for i, c in enumerate(chips)] == list(range(8))
    assert ascend.model_of("910B3") == "Ascend910B3"


def test_npu_smi_310p_table_names_each_chips_device_and_its_ddr() -> None:
    chips = ascend.parse_info(text("ascend", "info-310p3.txt"))
    got = [
        (c.npu_id, c.chip_id, c.device_id, c.memory_used_mib, c.memory_total_mib, c.power_w) for c in chips
    ]
    assert got == [(0, 0, 0, 1074, 21534, 15.8), (1, 0, 1, 1070, 21534, 15.4)]
    assert [ascend.device_index(c, 9) for c in chips] == [0, 1]  # the printed device id wins


def test_npu_smi_process_table_gives_each_chip_its_processes() -> None:
    chips = ascend.parse_info(text("ascend", "info-910b3-processes.txt"))
    assert [c.processes for c in chips] == [{1712733: 48954}, {}]
    assert [(c.aicore_pct, c.memory_used_mib) for c in chips] == [(7.0, 53984), (42.0, 52314)]
    (only,) = ascend.parse_info(text("ascend", "info-910b4-26.0.txt"))  # "No running processes found"
    assert (only.name, only.memory_total_mib, only.processes) == ("910B4", 32768, {})


def test_npu_smi_topology_joins_the_hccs_peers() -> None:
    pairs = ascend.parse_topo(text("ascend", "topo-910b3.txt"))
    assert len(pairs) == 28 and (0, 7) in pairs and all(a < b for a, b in pairs)  # 8 NPUs, all joined
    chips = ascend.parse_info(text("ascend", "info-910b3-24.1.txt"))
    assert set(ascend.npu_groups(chips, pairs).values()) == {"hccs-0"}
    assert ascend.npu_groups(chips, [(2, 3)]) == {2: "hccs-2", 3: "hccs-2"}
    assert ascend.npu_groups(chips, []) == {}


def test_npu_smi_garbage_is_no_chip() -> None:
    assert ascend.parse_info("npu-smi: command failed\n| nothing | here |\n") == []


# ---- Intel: xpu-smi -j --------------------------------------------------------------------------


def test_xpu_smi_discovery_and_detail() -> None:
    (dev,) = intel.parse_discovery(text("intel", "discovery.json"))
    assert dev == intel.XpuDevice(
        0, "Intel(R) Graphics [0x020a]", "00000000-0000-0000-0000-020a00008086", "0000:4d:00.0"
    )
    assert intel.parse_detail(text("intel", "discovery-d0.json")) == (32768, 512)
    assert intel.normalize_model(dev.name) == "Graphics-0x020a"
    assert intel.normalize_model("Intel(R) Data Center GPU Max 1550") == "Max-1550"
    assert intel.normalize_model("Intel(R) Arc(TM) A770 Graphics") == "Arc-A770"


def test_xpu_smi_stats_device_level_and_per_tile() -> None:
    s = intel.parse_stats(text("intel", "stats-device.json"))
    assert (s.utilization_pct, s.memory_used_mib, s.power_w) == (0.0, 229, 44.69)
    tiles = intel.parse_stats(text("intel", "stats-tiles.json"))
    assert tiles.power_w == 63.26  # the device's own figure, not the tiles' sum
    assert tiles.utilization_pct == 50.0  # no device-level figure: the tiles' mean (100 and 0)


def test_xpu_smi_topology_matrix_gives_the_xe_link_peers() -> None:
    assert intel.parse_topology(text("intel", "topology-m.txt")) == [(0, 1)]  # XL16 and XL* between cards
    assert intel.parse_topology("") == []


@pytest.mark.parametrize("bad", ["", "not json", "[]", '{"devices": []}'])
def test_xpu_smi_unreadable_output_is_a_tool_error(bad: str) -> None:
    with pytest.raises(ToolError):
        intel.parse_discovery(bad)


# ---- Apple: system_profiler + sysctl -------------------------------------------------------------


def test_system_profiler_apple_gpu_and_unified_memory() -> None:
    (gpu,) = apple.parse_displays(text("apple", "displays-m2-ultra.json"))
    assert gpu == apple.AppleGpu("M2-Ultra", 76, "metal3")
    assert apple.parse_sysctl(text("apple", "sysctl-m2-ultra.txt")) == (
        196608,
        "4C4C4544-0042-3510-8052-B4C04F4E3533",
    )
    assert apple.parse_displays(text("apple", "displays-intel-mac.json")) == []  # not Apple GPUs
    with pytest.raises(ToolError, match="hw.memsize"):
        apple.parse_sysctl("sysctl: unknown oid 'hw.memsize'\n")


# ---- AMD: the amdsmi library ---------------------------------------------------------------------


def test_amd_answers_become_watts_joules_and_process_memory() -> None:
    answers = json.loads(text("amd", "mi300x.json"))
    assert amd.socket_power(answers["amdsmi_get_power_info"]) == 412.0
    assert amd.socket_power({"current_socket_power": "N/A", "average_socket_power": 300}) == 300.0
    assert amd.socket_power({"current_socket_power": "N/A", "average_socket_power": "N/A"}) is None
    assert amd.energy_joules(answers["amdsmi_get_energy_count"]) == pytest.approx(31536000000 * 15.259 / 1e6)
    assert amd.process_vram(answers["amdsmi_get_gpu_process_list"]) == {4242: 36864}
    assert amd.normalize_model("AMD Instinct MI300X") == "MI300X"
    assert amd.normalize_model("AMD Radeon PRO W7900") == "Radeon-PRO-W7900"
    assert (
        amd.normalize_model("AMD Radeon Graphics (gfx1100)") == "Radeon-Graphics-gfx1100"
    )  # a name the pool takes
    assert amd.normalize_model("") == "AMD-GPU"


def test_amd_backend_without_amdsmi_says_why() -> None:
    if "amdsmi" in sys.modules or _importable("amdsmi"):
        pytest.skip("amdsmi is installed here")
    b = AmdBackend()
    assert not b.available() and b.discover() == [] and b.usage() == []
    assert "amdsmi Python library is not installed" in b.reason


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


class AmdSmiLibraryException(Exception):
    def __init__(self, err_code: int, text: str) -> None:
        super().__init__(text)
        self.err_code = err_code


def stand_in_amdsmi(gpus: int, links: set[tuple[int, int]]) -> types.ModuleType:
    """The calls the backend makes, answered with the recorded MI300X's dicts (the uuid, address,
    HIP id and render node varied per GPU), as the amdsmi Python API documents them."""
    answers: dict[str, Any] = json.loads(text("amd", "mi300x.json"))
    m = types.ModuleType("amdsmi")

    def per_gpu(key: str, vary: Any = None) -> Any:
        def call(h: int) -> Any:
            return vary(h) if vary else answers[key]

        return call

    m.amdsmi_init = lambda *a: None  # type: ignore[attr-defined]
    m.amdsmi_shut_down = lambda: None  # type: ignore[attr-defined]
    m.amdsmi_get_processor_handles = lambda: list(range(gpus))  # type: ignore[attr-defined]
    for key in answers:
        setattr(m, key, per_gpu(key))
    m.amdsmi_get_gpu_device_uuid = lambda h: f"1fff74a1-0000-1000-80e4-e5a1b2c3d4f{h}"  # type: ignore[attr-defined]
    m.amdsmi_get_gpu_device_bdf = lambda h: f"0000:{0x0C + h:02x}:00.0"  # type: ignore[attr-defined]
    m.amdsmi_get_gpu_enumeration_info = lambda h: {  # type: ignore[attr-defined]
        **answers["amdsmi_get_gpu_enumeration_info"],
        "hip_id": h,
        "drm_render": 128 + h,
    }

    def link(a: int, b: int) -> dict[str, int]:
        return {"hops": 1, "type": 2 if (min(a, b), max(a, b)) in links else 1}

    def energy(h: int) -> dict[str, Any]:
        if h == 2:
            raise AmdSmiLibraryException(2, "AMDSMI_STATUS_NOT_SUPPORTED")  # not a fault
        if h == 3:
            raise AmdSmiLibraryException(8, "AMDSMI_STATUS_DRM_ERROR")
        return dict(answers["amdsmi_get_energy_count"])

    m.amdsmi_topo_get_link_type = link  # type: ignore[attr-defined]
    m.amdsmi_get_energy_count = energy  # type: ignore[attr-defined]
    return m


def test_amd_backend_reports_gpus_xgmi_groups_and_usage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", stand_in_amdsmi(4, {(0, 1), (2, 3)}))
    b = AmdBackend()
    assert b.available() and b.reason == ""
    devs = b.discover()
    got = [(d.index, d.vendor, d.model, d.memory_mib, d.physical_index, d.link_group, d.cores) for d in devs]
    assert got == [
        (0, "amd", "MI300X", 196592, 0, "xgmi-0", 304),
        (1, "amd", "MI300X", 196592, 1, "xgmi-0", 304),
        (2, "amd", "MI300X", 196592, 2, "xgmi-2", 304),
        (3, "amd", "MI300X", 196592, 3, "xgmi-2", 304),
    ]
    assert devs[0].uuid.endswith("f0") and devs[0].compute_capability == "gfx942"
    use = b.usage()
    assert [(u.index, u.utilization_pct, u.memory_used_mib, u.power_w) for u in use] == [
        (i, 37.0, 40960, 412.0) for i in range(4)
    ]
    assert use[0].process_memory_mib == {4242: 36864}
    assert use[2].energy_j is None and use[2].health == ""  # not supported: no energy, still healthy
    assert (
        use[3].energy_j is None and "amdsmi_get_energy_count failed: AMDSMI_STATUS_DRM_ERROR" in use[3].health
    )
