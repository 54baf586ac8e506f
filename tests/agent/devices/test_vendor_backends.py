"""The tool-driven backends end to end through real processes: stand-in `xpu-smi`, `npu-smi`,
`system_profiler` and `sysctl` scripts that print the recorded outputs under data/; a missing or
failing tool is a reason, never an exception; and a node with several vendors' devices."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import computepool
from computepool.agent.devices import (
    AppleBackend,
    AscendBackend,
    CompositeBackend,
    IntelBackend,
    SimulatedBackend,
    discover_all,
)

DATA = Path(__file__).parent / "data"


def tool(tmp_path: Path, name: str, answers: dict[str, str]) -> str:
    """An executable `name` that prints the file answering its arguments (`answers`: args → file)."""
    cases = "".join(
        f"  {shlex.quote(args)}) cat {shlex.quote(str(DATA / f))} ;;\n" for args, f in answers.items()
    )
    script = tmp_path / name
    script.write_text(
        f'#!/bin/sh\ncase "$*" in\n{cases}  *) echo "{name}: unknown arguments $*" >&2; exit 2 ;;\nesac\n'
    )
    script.chmod(0o755)
    return str(script)


INTEL = {
    "discovery -j": "intel/discovery.json",
    "discovery -d 0 -j": "intel/discovery-d0.json",
    "stats -d 0 -j": "intel/stats-device.json",
    "topology -m": "intel/topology-m.txt",  # names a second GPU this node lacks: no group
}


def test_intel_backend_through_xpu_smi(tmp_path: Path) -> None:
    b = IntelBackend(tool(tmp_path, "xpu-smi", INTEL))
    assert b.available() and b.reason == ""
    (d,) = b.discover()
    assert (d.vendor, d.model, d.memory_mib, d.physical_index, d.cores) == (
        "intel",
        "Graphics-0x020a",
        32768,
        0,
        512,
    )
    assert d.uuid == "00000000-0000-0000-0000-020a00008086" and d.link_group == ""
    (u,) = b.usage()
    assert (u.utilization_pct, u.memory_used_mib, u.power_w, u.health) == (0.0, 229, 44.69, "")


def test_intel_stats_failing_is_the_devices_health(tmp_path: Path) -> None:
    b = IntelBackend(tool(tmp_path, "xpu-smi", {k: v for k, v in INTEL.items() if "stats" not in k}))
    assert b.available()
    (u,) = b.usage()
    assert u.health.startswith("xpu-smi stats failed:") and "unknown arguments stats -d 0 -j" in u.health


def test_ascend_backend_groups_hccs_peers(tmp_path: Path) -> None:
    answers = {"info": "ascend/info-910b3-24.1.txt", "info -t topo": "ascend/topo-910b3.txt"}
    devs = AscendBackend(tool(tmp_path, "npu-smi", answers)).discover()
    assert [(d.physical_index, d.link_group) for d in devs] == [(i, "hccs-0") for i in range(8)]
    assert devs[4].uuid == "ascend-0000:01:00.0" and devs[4].memory_mib == 65536


def test_ascend_backend_through_npu_smi(tmp_path: Path) -> None:
    b = AscendBackend(tool(tmp_path, "npu-smi", {"info": "ascend/info-910b3-processes.txt"}))
    devs = b.discover()
    got = [(d.index, d.vendor, d.model, d.memory_mib, d.physical_index, d.uuid) for d in devs]
    assert got == [
        (0, "ascend", "Ascend910B3", 65536, 0, "ascend-0000:c1:00.0"),
        (1, "ascend", "Ascend910B3", 65536, 1, "ascend-0000:c2:00.0"),
    ]
    use = b.usage()
    assert [(u.utilization_pct, u.memory_used_mib, u.power_w, u.health) for u in use] == [
        (7.0, 53984, 90.7, ""),
        (42.0, 52314, 96.9, ""),
    ]
    assert use[0].process_memory_mib == {1712733: 48954}


def test_apple_backend_through_system_profiler(tmp_path: Path) -> None:
    b = AppleBackend(
        profiler=tool(
            tmp_path, "system_profiler", {"SPDisplaysDataType -json": "apple/displays-m2-ultra.json"}
        ),
        sysctl=tool(tmp_path, "sysctl", {"-n hw.memsize kern.uuid": "apple/sysctl-m2-ultra.txt"}),
        platform="darwin",
    )
    (d,) = b.discover()
    assert (d.vendor, d.model, d.memory_mib, d.cores) == ("apple", "M2-Ultra", 196608, 76)
    assert d.uuid == "apple-4C4C4544-0042-3510-8052-B4C04F4E3533-0"
    assert [(u.utilization_pct, u.power_w) for u in b.usage()] == [(None, None)]
    assert "not macOS" in AppleBackend(platform="linux").reason


def test_missing_or_failing_tools_are_reasons(tmp_path: Path) -> None:
    missing = IntelBackend(str(tmp_path / "no-xpu-smi"))
    assert not missing.available() and missing.discover() == [] and missing.usage() == []
    assert missing.reason == f"xpu-smi unavailable: {tmp_path / 'no-xpu-smi'} not found on PATH"
    if shutil.which("npu-smi") is None:  # the default: looked up on PATH
        assert AscendBackend().reason == "npu-smi unavailable: npu-smi not found on PATH"
    failing = tmp_path / "bad" / "npu-smi"
    failing.parent.mkdir()
    failing.write_text("#!/bin/sh\necho 'dcmi module initialize failed. ret is -8005' >&2\nexit 3\n")
    failing.chmod(0o755)
    b = AscendBackend(str(failing))
    assert not b.available()
    assert (
        b.reason
        == f"npu-smi unavailable: {failing} info exited 3: dcmi module initialize failed. ret is -8005"
    )


def test_a_node_with_several_vendors_numbers_them_in_turn(tmp_path: Path) -> None:
    intel = IntelBackend(tool(tmp_path, "xpu-smi", INTEL))
    ascend = AscendBackend(tool(tmp_path, "npu-smi", {"info": "ascend/info-910b3-processes.txt"}))
    absent = IntelBackend(str(tmp_path / "absent"))
    inv = discover_all(backends=[absent, ascend, intel])
    assert isinstance(inv.backend, CompositeBackend)
    assert [(d.index, d.vendor, d.physical_index) for d in inv.devices] == [
        (0, "ascend", 0),
        (1, "ascend", 1),
        (2, "intel", 0),
    ]
    assert inv.notes == [absent.reason]
    use = inv.backend.usage()
    assert [(u.index, u.uuid, u.memory_used_mib) for u in use] == [
        (0, "ascend-0000:c1:00.0", 53984),
        (1, "ascend-0000:c2:00.0", 52314),
        (2, "00000000-0000-0000-0000-020a00008086", 229),
    ]
    one = discover_all(backends=[absent, intel])
    assert one.backend is intel and [d.index for d in one.devices] == [0]
    none = discover_all(backends=[absent])
    assert none.backend is None and none.devices == [] and none.notes == [absent.reason]
    assert isinstance(discover_all("1xMI300X", backends=[intel]).backend, SimulatedBackend)


def test_the_devices_module_prints_what_the_agent_would_find() -> None:
    run = [sys.executable, "-m", "computepool.agent.devices"]
    env = {**os.environ, "PYTHONPATH": str(Path(computepool.__file__).parent.parent)}
    done = subprocess.run(
        [*run, "--simulate", "1xMI300X,1xAscend910B", "--usage"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["backend"] == "simulated"
    assert [(d["vendor"], d["model"], d["env"]) for d in got["devices"]] == [
        ("amd", "MI300X", {"HIP_VISIBLE_DEVICES": "0", "ROCR_VISIBLE_DEVICES": "0"}),
        ("ascend", "Ascend910B", {"ASCEND_RT_VISIBLE_DEVICES": "0"}),
    ]
    assert [u["power_w"] for u in got["usage"]] == [110.0, 50.0]  # idle: MI300X's model, the default's
    bad = subprocess.run([*run, "--simulate", "2xFOO"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: simulate: unknown model 'FOO'") and len(bad.stderr.splitlines()) == 1
