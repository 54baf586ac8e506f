"""Device backends: simulated spec parsing and usage, NVML without a driver, CPU inventory."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from computepool.agent.devices import (
    DeviceBackend,
    NvidiaBackend,
    SimulatedBackend,
    cpu_inventory,
    cpu_usage,
    discover_all,
    parse_spec,
)
from computepool.agent.devices.nvidia import normalize_bus_id, normalize_model
from computepool.core.errors import InvalidInput


def test_spec_counts_models_and_memory_forms() -> None:
    specs = parse_spec("2xA100-80GB, 1xT4-16GB,L4-24G,RTX-4090-24GiB,amd/MI300X-192GB,3*V100M32-32768MiB")
    got = [(s.vendor, s.model, s.memory_mib, s.count) for s in specs]
    assert got == [
        ("nvidia", "A100", 81920, 2),
        ("nvidia", "T4", 16384, 1),
        ("nvidia", "L4", 24576, 1),
        ("nvidia", "RTX-4090", 24576, 1),
        ("amd", "MI300X", 196608, 1),
        ("nvidia", "V100M32", 32768, 3),
    ]


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("", "empty"),
        ("2xA100", "'2xA100'"),
        ("2xA100-80XB", "'XB'"),
        ("0xA100-80GB", "count"),
        ("2xA100-80GB,,T4-16GB", "''"),
        ("A100-0GB", "memory"),
        ("65xT4-16GB", "count"),
        ("2xA100-80GB;1xT4-16GB", "'2xA100-80GB;1xT4-16GB'"),
    ],
)
def test_bad_spec_names_the_part(spec: str, named: str) -> None:
    with pytest.raises(InvalidInput) as e:
        parse_spec(spec)
    assert named in str(e.value)


def test_spec_from_json_file(tmp_path: Path) -> None:
    f = tmp_path / "devices.json"
    f.write_text(
        json.dumps(
            [
                {"model": "H100", "memory_mib": 81559, "count": 2, "link_group": "nv0"},
                {"model": "T4", "memory_mib": 15360},
            ]
        )
    )
    backend = SimulatedBackend(str(f), seed="node-a")
    devices = backend.discover()
    assert [(d.index, d.model, d.memory_mib, d.link_group) for d in devices] == [
        (0, "H100", 81559, "nv0"),
        (1, "H100", 81559, "nv0"),
        (2, "T4", 15360, ""),
    ]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"model": "T4", "memory_mib": 100}, {"model": "T4", "memory": 1}]))
    with pytest.raises(InvalidInput, match=r"bad.json\[1\].*unknown field"):
        parse_spec(str(bad))
    with pytest.raises(InvalidInput, match="not found"):
        parse_spec(str(tmp_path / "missing.json"))


def test_simulated_uuids_are_stable_per_node_and_distinct_across_nodes() -> None:
    a1 = SimulatedBackend("2xT4-16GB", seed="node-a").discover()
    a2 = SimulatedBackend("2xT4-16GB", seed="node-a").discover()
    b = SimulatedBackend("2xT4-16GB", seed="node-b").discover()
    assert [d.uuid for d in a1] == [d.uuid for d in a2]
    assert len({d.uuid for d in a1 + b}) == 4
    assert all(d.uuid.startswith("GPU-") for d in a1)


def test_simulated_usage_follows_attached_processes(tmp_path: Path) -> None:
    backend = SimulatedBackend("2xA100-80GB", seed="t")
    assert isinstance(backend, DeviceBackend) and backend.available()
    p1 = subprocess.Popen(["sleep", "30"])
    p2 = subprocess.Popen(["sleep", "30"])
    try:
        backend.attach(p1.pid, 0, 4000, 300)
        backend.attach(p2.pid, 0, 2000, 800)
        u0, u1 = backend.usage()
        assert (u0.utilization_pct, u0.memory_used_mib, u0.process_memory_mib) == (
            100.0,
            6000,
            {p1.pid: 4000, p2.pid: 2000},
        )
        assert (u1.utilization_pct, u1.memory_used_mib, u1.process_memory_mib) == (0.0, 0, {})
        backend.detach(p2.pid)
        assert backend.usage()[0].utilization_pct == 30.0
        # a workload reports more than it was given through its memory file
        mem_file = tmp_path / "sim_gpu_memory_mib"
        backend.attach(p2.pid, 1, 1000, 500, memory_file=mem_file)
        assert backend.usage()[1].process_memory_mib == {p2.pid: 1000}
        mem_file.write_text("12000\n")
        assert backend.usage()[1].memory_used_mib == 12000
        # processes that exit are dropped without a detach
        p1.kill()
        p1.wait()
        assert backend.usage()[0].process_memory_mib == {}
        assert backend.attached_pids() == {p2.pid}
        with pytest.raises(InvalidInput, match="device_index"):
            backend.attach(p2.pid, 5, 1, 1)
    finally:
        for p in (p1, p2):
            p.kill()
            p.wait()


def test_nvml_backend_reports_unavailable_without_raising() -> None:
    backend = NvidiaBackend()
    if backend.available():
        pytest.skip("an NVIDIA driver is present here")
    assert backend.reason.startswith("NVML")
    assert backend.discover() == []
    assert backend.usage() == []
    assert backend.mig_modes() == {}
    assert isinstance(backend, DeviceBackend)


def test_nvml_name_helpers() -> None:
    assert normalize_model("NVIDIA A100-SXM4-80GB") == "A100-SXM4-80GB"
    assert normalize_model("NVIDIA A100-SXM4-40GB MIG 3g.20gb") == "A100-SXM4-40GB-MIG-3g.20gb"
    assert normalize_model("NVIDIA A100-SXM4-80GB MIG 1g.10gb+me") == "A100-SXM4-80GB-MIG-1g.10gb-me"
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"


def test_cpu_inventory_and_usage() -> None:
    inv = cpu_inventory()
    assert inv.cpu_milli >= 1000 and inv.logical_cpus >= 1
    assert inv.memory_mib > 0 and inv.numa_nodes >= 1
    use = cpu_usage()
    assert 0 <= use.memory_used_mib <= inv.memory_mib + use.memory_available_mib
    assert 0.0 <= use.cpu_pct <= 100.0


def test_discover_all() -> None:
    sim = discover_all("1xA100-80GB,2xT4-16GB", seed="n1")
    assert isinstance(sim.backend, SimulatedBackend)
    assert [d.model for d in sim.devices] == ["A100", "T4", "T4"]
    core = sim.devices[1].to_device()
    assert (core.index, core.model, core.memory_mib, core.compute_milli) == (1, "T4", 16384, 1000)
    assert sim.cpu.cpu_milli >= 1000
    real = discover_all(None)
    if real.backend is None:
        assert real.devices == [] and real.notes and real.notes[0].startswith("NVML")
    with pytest.raises(InvalidInput, match="simulate"):
        discover_all("bogus")


def test_simulated_mig_instances_look_like_nvml_ones(tmp_path: Path) -> None:
    devices = SimulatedBackend("1xA100-80GB:mig=3g.40gb+2g.20gb+2g.20gb,1xA100-80GB", seed="n").discover()
    got = [(d.index, d.model, d.memory_mib, d.compute_milli, d.physical_index) for d in devices]
    assert got == [
        (0, "A100-MIG-3g.40gb", 40960, 429, 0),
        (1, "A100-MIG-2g.20gb", 20480, 286, 0),
        (2, "A100-MIG-2g.20gb", 20480, 286, 0),
        (3, "A100", 81920, 1000, 1),
    ]
    parent = devices[0].mig_parent_uuid
    assert parent is not None and parent.startswith("GPU-") and devices[3].mig_parent_uuid is None
    assert {d.mig_parent_uuid for d in devices[:3]} == {parent} and parent != devices[3].uuid
    assert all(d.uuid.startswith("MIG-") for d in devices[:3]) and len({d.uuid for d in devices}) == 4
    again = SimulatedBackend("1xA100-80GB:mig=3g.40gb+2g.20gb+2g.20gb,1xA100-80GB", seed="n").discover()
    assert [d.uuid for d in again] == [d.uuid for d in devices]  # stable across agent restarts
    assert (devices[1].to_device().kind, devices[1].to_device().mig_profile) == ("mig", "2g.20gb")
    assert devices[3].to_device().kind == "gpu"
    f = tmp_path / "mig.json"
    f.write_text(json.dumps([{"model": "H100", "memory_mib": 81920, "mig": ["4g.40gb", "3g.40gb"]}]))
    assert [d.model for d in parse_and_discover(str(f))] == ["H100-MIG-4g.40gb", "H100-MIG-3g.40gb"]
    plus = parse_and_discover("1xA100-80GB:mig=1g.10gb+me+1g.10gb")
    assert [d.to_device().mig_profile for d in plus] == ["1g.10gb+me", "1g.10gb"]


def parse_and_discover(spec: str) -> list:
    return SimulatedBackend(spec, seed="x").discover()


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("1xA100-80GB:mig=4g.40gb+4g.40gb", "take 8 slices, more than the GPU's 7"),
        ("1xA100-40GB:mig=3g.40gb+2g.20gb", "take 61440 MiB, more than the GPU's 40960 MiB"),
        ("1xA100-80GB:mig=5g.50gb", "unknown MIG profile '5g.50gb'"),
        ("1xA100-80GB:mig=3g", "unknown MIG profile '3g'"),
        ("1xA100-80GB:mig=", "lists no instance"),
        ("1xA100-80GB:slices=7", "unknown option 'slices=7'"),
        ("10xA100-80GB:mig=" + "+".join(["1g.10gb"] * 7), "70 devices is more than a node holds"),
    ],
)
def test_bad_mig_layouts_name_the_spec(spec: str, words: str) -> None:
    with pytest.raises(InvalidInput) as e:
        parse_spec(spec)
    assert words in str(e.value) and (spec.split(",")[0] in str(e.value) or "devices" in words)
