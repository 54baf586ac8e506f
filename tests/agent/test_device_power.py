"""Device power, energy and health: the simulated backend's model and counter, and the NVIDIA
backend's reading of NVML's power, energy and XID events (against the stand-in NVML of
test_agent_nvidia_logic, which answers as nvidia-ml-py documents)."""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from test_agent_nvidia_logic import NVMLError, fake_nvml

from computepool.agent.devices import NvidiaBackend, SimulatedBackend
from computepool.core.errors import InvalidInput
from computepool.core.power import model_power


class Clock:
    """A clock the test moves by hand, so energy is exact."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def test_simulated_power_follows_utilization_and_energy_integrates_it(
    sleeper: subprocess.Popen[bytes],
) -> None:
    clock = Clock()
    backend = SimulatedBackend("2xA100-80GB,1xT4-16GB", seed="p", clock=clock)
    # the model the pool knows the device by (what the ledger prices and models too)
    assert [d.model for d in backend.discover()] == ["A100", "A100", "T4"]
    a100, t4 = model_power("A100"), model_power("T4")
    assert a100.idle_w < a100.peak_w and t4.peak_w < a100.peak_w
    first = backend.usage()
    assert [u.power_w for u in first] == [a100.idle_w, a100.idle_w, t4.idle_w]
    assert [u.energy_j for u in first] == [0.0, 0.0, 0.0]
    assert [u.health for u in first] == ["", "", ""]

    backend.attach(sleeper.pid, 0, 1000, 600)  # 60 % of device 0
    clock.t += 10.0
    u = backend.usage()
    busy = a100.watts(60.0)
    assert u[0].utilization_pct == 60.0 and u[0].power_w == pytest.approx(busy)
    assert u[0].energy_j == pytest.approx(10.0 * busy)
    assert u[1].utilization_pct == 0.0 and u[1].energy_j == pytest.approx(10.0 * a100.idle_w)
    assert u[2].energy_j == pytest.approx(10.0 * t4.idle_w)

    clock.t += 5.0
    backend.detach(sleeper.pid)  # books the busy draw up to the detach
    clock.t += 20.0
    u = backend.usage()
    assert u[0].power_w == a100.idle_w
    assert u[0].energy_j == pytest.approx(15.0 * busy + 20.0 * a100.idle_w)
    assert u[1].energy_j == pytest.approx(35.0 * a100.idle_w)


def test_a_process_that_exits_stops_drawing_when_it_is_seen_gone() -> None:
    clock = Clock()
    backend = SimulatedBackend("1xH100-80GB", seed="p", clock=clock)
    h100 = model_power("H100")
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        backend.attach(p.pid, 0, 1000, 1000)
        clock.t += 4.0
        assert backend.usage()[0].power_w == h100.peak_w
        assert p.stdin is not None
        p.stdin.close()
        p.wait()
        clock.t += 6.0
        assert backend.attached_pids() == set()  # seen gone here: busy until now, idle after
        clock.t += 10.0
        u = backend.usage()[0]
    finally:
        p.kill()
        p.wait()
    assert u.utilization_pct == 0.0 and u.power_w == h100.idle_w
    assert u.energy_j == pytest.approx(10.0 * h100.peak_w + 10.0 * h100.idle_w)


def test_energy_counter_never_goes_back() -> None:
    backend = SimulatedBackend("1xL4-24GB", seed="p")
    readings = [backend.usage()[0].energy_j for _ in range(50)]
    assert all(r is not None for r in readings)
    assert readings == sorted(readings)  # type: ignore[type-var]


def test_mig_instances_report_no_power_of_their_own(sleeper: subprocess.Popen[bytes]) -> None:
    clock = Clock()
    backend = SimulatedBackend("1xA100-80GB:mig=3g.40gb+2g.20gb,1xA100-80GB", seed="p", clock=clock)
    backend.attach(sleeper.pid, 0, 1000, 400)
    clock.t += 3.0
    mig_a, mig_b, whole = backend.usage()
    assert (mig_a.power_w, mig_a.energy_j, mig_b.power_w, mig_b.energy_j) == (None, None, None, None)
    assert mig_a.utilization_pct is not None and mig_a.utilization_pct > 0
    assert whole.power_w == model_power("A100").idle_w
    assert whole.energy_j == pytest.approx(3.0 * model_power("A100").idle_w)


def test_simulated_health_can_be_set_and_cleared() -> None:
    backend = SimulatedBackend("2xT4-16GB", seed="p")
    backend.set_health(1, "XID 79 (simulated)")
    assert [u.health for u in backend.usage()] == ["", "XID 79 (simulated)"]
    backend.set_health(1, "")
    assert [u.health for u in backend.usage()] == ["", ""]
    with pytest.raises(InvalidInput, match="device_index"):
        backend.set_health(2, "x")


# ---- NVIDIA ---------------------------------------------------------------------------------


class NotSupported(NVMLError):
    value = 3  # NVML_ERROR_NOT_SUPPORTED, as nvidia-ml-py's error classes carry it


class GpuIsLost(NVMLError):
    value = 15


XID_CRITICAL = 8  # nvmlEventTypeXidCriticalError


def with_power(nv: types.ModuleType) -> types.ModuleType:
    """Add what NVML answers for power, energy and events: per GPU mW, mJ and a queue of XIDs."""
    power_mw = {"GPU-0": 312_456, "GPU-1": 70_000, "GPU-2": 95_500}
    energy_mj = {"GPU-0": 9_876_543_210, "GPU-1": 1_000, "GPU-2": 42_000_000}
    queues: dict[int, list[int]] = {}
    sets: dict[int, str] = {}  # event set → the GPU registered on it

    def per_gpu(table: dict[str, int]) -> object:
        def read(d: object) -> int:
            uuid = d.uuid  # type: ignore[attr-defined]
            if uuid.startswith("MIG-"):
                raise NotSupported("Not Supported")  # NVML reads power per GPU only
            return table[uuid]

        return read

    def create() -> int:
        es = len(queues) + 1
        queues[es] = []
        return es

    def register(d: object, kinds: int, es: int) -> None:
        assert kinds == XID_CRITICAL
        sets[es] = d.uuid  # type: ignore[attr-defined]

    def wait(es: int, timeout_ms: int) -> object:
        assert timeout_ms == 0  # never blocks the heartbeat
        if not queues[es]:
            raise NVMLError("Timeout")
        return SimpleNamespace(eventType=XID_CRITICAL, eventData=queues[es].pop(0))

    def xid(gpu_uuid: str, *codes: int) -> None:
        for es, uuid in sets.items():
            if uuid == gpu_uuid:
                queues[es].extend(codes)

    nv.NVML_ERROR_NOT_SUPPORTED = 3  # type: ignore[attr-defined]
    nv.nvmlEventTypeXidCriticalError = XID_CRITICAL  # type: ignore[attr-defined]
    nv.nvmlDeviceGetPowerUsage = per_gpu(power_mw)  # type: ignore[attr-defined]
    nv.nvmlDeviceGetTotalEnergyConsumption = per_gpu(energy_mj)  # type: ignore[attr-defined]
    nv.nvmlEventSetCreate = create  # type: ignore[attr-defined]
    nv.nvmlDeviceRegisterEvents = register  # type: ignore[attr-defined]
    nv.nvmlEventSetWait = wait  # type: ignore[attr-defined]
    nv.nvmlEventSetFree = lambda es: sets.pop(es, None)  # type: ignore[attr-defined]
    nv.power_mw, nv.energy_mj, nv.xid, nv.sets = power_mw, energy_mj, xid, sets  # type: ignore[attr-defined]
    return nv


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    m = with_power(fake_nvml())
    monkeypatch.setitem(sys.modules, "pynvml", m)
    return m


def test_nvml_power_in_watts_energy_in_joules_none_for_mig(nvml: types.ModuleType) -> None:
    backend = NvidiaBackend()
    backend.discover()
    usage = backend.usage()
    assert [(u.uuid, u.power_w, u.energy_j, u.health) for u in usage] == [
        ("GPU-0", 312.456, 9_876_543.21, ""),
        ("GPU-1", 70.0, 1.0, ""),
        ("MIG-a", None, None, ""),  # the GPU's draw is all its instances'
        ("MIG-b", None, None, ""),
    ]


def test_a_board_without_an_energy_counter_is_healthy(nvml: types.ModuleType) -> None:
    def unsupported(d: object) -> int:
        raise NotSupported("Not Supported")

    nvml.nvmlDeviceGetTotalEnergyConsumption = unsupported  # type: ignore[attr-defined]
    u = NvidiaBackend().usage()[0]
    assert (u.power_w, u.energy_j, u.health) == (312.456, None, "")


def test_old_bindings_without_the_calls_are_healthy(nvml: types.ModuleType) -> None:
    for name in ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption", "nvmlEventSetCreate"):
        delattr(nvml, name)
    usage = NvidiaBackend().usage()
    assert [(u.power_w, u.energy_j, u.health) for u in usage[:2]] == [(None, None, ""), (None, None, "")]


def test_a_failing_nvml_query_names_itself_in_health(nvml: types.ModuleType) -> None:
    def lost(d: object) -> int:
        if d.uuid == "GPU-1":  # type: ignore[attr-defined]
            raise GpuIsLost("GPU is lost")
        return 100_000

    nvml.nvmlDeviceGetPowerUsage = lost  # type: ignore[attr-defined]
    usage = NvidiaBackend().usage()
    assert usage[0].health == "" and usage[0].power_w == 100.0
    assert usage[1].health == "nvmlDeviceGetPowerUsage failed: GPU is lost"
    assert usage[1].power_w is None and usage[1].energy_j == 1.0  # the other readings still come


def test_critical_xids_mark_the_gpu_and_its_instances_application_xids_do_not(
    nvml: types.ModuleType,
) -> None:
    backend = NvidiaBackend()
    backend.discover()
    assert all(u.health == "" for u in backend.usage())  # registers one event set per GPU
    assert sorted(nvml.sets.values()) == ["GPU-0", "GPU-1", "GPU-2"]
    nvml.xid("GPU-0", 13, 43)  # a job's own faults (illegal address, stopped by the user)
    nvml.xid("GPU-1", 79)  # fallen off the bus
    nvml.xid("GPU-2", 48, 48, 31)  # double-bit ECC, twice, and a job's MMU fault
    usage = backend.usage()
    assert [u.health for u in usage] == [
        "",
        "the driver reported critical XID 79",
        "the driver reported critical XID 48",
        "the driver reported critical XID 48",
    ]
    assert backend.usage()[1].health == "the driver reported critical XID 79"  # until a restart
    backend.close()
    assert nvml.sets == {}  # the event sets are freed


def test_gpus_without_events_are_skipped_quietly(nvml: types.ModuleType) -> None:
    def refuse(d: object, kinds: int, es: int) -> None:
        raise NotSupported("Not Supported")

    nvml.nvmlDeviceRegisterEvents = refuse  # type: ignore[attr-defined]
    usage = NvidiaBackend().usage()
    assert [u.health for u in usage] == ["", "", "", ""]
    assert usage[0].power_w == 312.456


def test_a_gpu_that_vanishes_after_discovery_makes_every_device_unhealthy(nvml: types.ModuleType) -> None:
    backend = NvidiaBackend()
    known = backend.discover()

    def lost(i: int) -> object:
        raise GpuIsLost("GPU is lost")

    nvml.nvmlDeviceGetHandleByIndex = lost  # type: ignore[attr-defined]
    usage = backend.usage()
    assert [u.uuid for u in usage] == [d.uuid for d in known]
    assert all(u.health == "NVML cannot enumerate the GPUs: GPU is lost" for u in usage)
    assert all(u.utilization_pct is None and u.power_w is None for u in usage)
