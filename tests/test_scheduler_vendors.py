"""Requests by capability over a pool of several vendors: vendors, a floor on device memory, and
isolation tiers only where the device's vendor enforces them (core/vendors.py).

The oracle is written from those rules, not from the filters: on an idle node a request fits when
`gpu_count` of its devices are of an allowed vendor, at least `min_gpu_memory_mib` big, of a
vendor that enforces the request's tier (exclusive: every vendor; timeslice: NVIDIA and AMD; mps:
NVIDIA), and host CPU and memory fit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from computepool.agent.devices.base import DeviceInfo
from computepool.agent.devices.stack import stack_labels
from computepool.client.options import parse_stacks
from computepool.core import Device, Isolation, Node, Request
from computepool.core.errors import InvalidInput
from computepool.scheduler.constraints import NodeConstraints, NodeRules
from computepool.scheduler.filters import explain, feasibility, node_feasible
from computepool.scheduler.pickers import pick_on_node
from computepool.scheduler.state import ClusterState

KINDS = [("nvidia", "A100", 81920), ("amd", "MI300X", 196608), ("ascend", "Ascend910B", 65536),
         ("intel", "Max-1550", 131072), ("simulated", "T4", 15360)]  # fmt: skip
ENFORCES = {
    "exclusive": {"nvidia", "amd", "ascend", "intel", "simulated"},
    "timeslice": {"nvidia", "amd", "simulated"},
    "mps": {"nvidia", "simulated"},
}


@st.composite
def pools(draw: st.DrawFn) -> list[Node]:
    nodes = []
    for i in range(draw(st.integers(1, 5))):
        kinds = draw(st.lists(st.sampled_from(KINDS), min_size=0, max_size=4))
        devices = [Device(index=j, vendor=v, model=m, memory_mib=mem) for j, (v, m, mem) in enumerate(kinds)]
        nodes.append(Node(name=f"n{i}", cpu_milli=8000, memory_mib=65536, devices=devices))
    return nodes


@st.composite
def requests(draw: st.DrawFn) -> Request:
    tier = draw(st.sampled_from(["exclusive", "timeslice", "mps"]))
    count = 1 if tier != "exclusive" else draw(st.integers(1, 3))
    vendors = draw(st.one_of(st.none(), st.frozensets(st.sampled_from(["nvidia", "amd", "ascend", "intel"]),
                                                     min_size=1)))  # fmt: skip
    floor = draw(st.sampled_from([0, 65536, 100000]))
    return Request(
        gpu_count=count,
        gpu_milli=1000 if tier == "exclusive" else 500,
        isolation=Isolation(tier),
        vendors=vendors,
        min_gpu_memory_mib=floor,
        tenant="t",
    )


def oracle(node: Node, req: Request) -> bool:
    def ok(d: Device) -> bool:
        vendor = "nvidia" if d.vendor == "simulated" else d.vendor
        return (
            (req.vendors is None or vendor in req.vendors)
            and d.memory_mib >= req.min_gpu_memory_mib
            and d.vendor in ENFORCES[str(req.tier)]
        )

    return sum(ok(d) for d in node.devices) >= req.gpu_count


@settings(max_examples=300, deadline=None)
@given(pools(), requests())
def test_a_node_fits_exactly_when_enough_of_its_devices_have_what_is_asked(
    nodes: list[Node], req: Request
) -> None:
    state = ClusterState.from_nodes(nodes)
    want = [oracle(n, req) for n in nodes]
    assert node_feasible(state, req).tolist() == want
    feas = feasibility(state, state.node_view(), req)
    assert feas.ok.tolist() == want
    for i, node in enumerate(nodes):
        mask = pick_on_node(state, i, req)
        assert bool(mask) == want[i]
        for j in range(len(node.devices)):  # what was picked has what was asked
            if mask >> j & 1:
                assert oracle(Node("one", 1, 1, [node.devices[j]]), Request(
                    gpu_count=1, gpu_milli=req.gpu_milli, isolation=req.isolation, vendors=req.vendors,
                    min_gpu_memory_mib=req.min_gpu_memory_mib))  # fmt: skip


def _state() -> ClusterState:
    return ClusterState.from_nodes(
        [
            Node(
                "amd", 8000, 65536, [Device(0, "amd", "MI300X", 196608), Device(1, "amd", "MI300X", 196608)]
            ),
            Node("npu", 8000, 65536, [Device(0, "ascend", "Ascend910B", 65536)]),
            Node("gpu", 8000, 65536, [Device(0, "nvidia", "A100", 81920)]),
        ]
    )


def test_explain_names_the_vendor_the_tier_or_the_size_a_node_lacks() -> None:
    state = _state()
    text = str(explain(state, Request(gpu_count=1, gpu_milli=1000, vendors=frozenset({"intel"}))))
    assert text == "3 nodes: 3 no Intel device"
    text = str(explain(state, Request(gpu_count=1, gpu_milli=500, isolation=Isolation.MPS)))
    assert "1 AMD devices cannot enforce mps" in text and "1 Huawei Ascend devices cannot enforce mps" in text
    text = str(explain(state, Request(gpu_count=1, gpu_milli=1000, min_gpu_memory_mib=100 * 1024)))
    assert "2 no device with 100GiB GPU memory" in text  # the AMD node fits
    assert explain(state, Request(gpu_count=2, gpu_milli=1000, vendors=frozenset({"amd"}))).counts == {
        "no AMD device": 2
    }


def test_a_timeslice_fraction_never_lands_where_it_cannot_be_held() -> None:
    state = _state()
    req = Request(gpu_count=1, gpu_milli=250, tenant="t")  # timeslice by default
    assert node_feasible(state, req).tolist() == [True, False, True]


def test_bad_capabilities_are_refused_naming_the_field() -> None:
    with pytest.raises(InvalidInput) as e:
        Request(gpu_count=1, gpu_milli=1000, vendors=frozenset({"nvdia"}))
    assert e.value.where == "vendors" and "unknown vendor 'nvdia'" in e.value.message
    with pytest.raises(InvalidInput) as e:
        Request(cpu_milli=1000, vendors=frozenset({"amd"}))
    assert e.value.where == "vendors"
    with pytest.raises(InvalidInput) as e:
        Request(gpu_count=1, gpu_milli=1000, min_gpu_memory_mib=-1)
    assert e.value.where == "min_gpu_memory_mib"


def test_a_stack_request_goes_to_nodes_labelled_that_version_or_later() -> None:
    nodes = [
        Node("old", 8000, 65536, [Device(0, "nvidia", "A100", 81920)], labels={"stack.cuda": "12.2"}),
        Node("new", 8000, 65536, [Device(0, "nvidia", "A100", 81920)], labels={"stack.cuda": "12.10"}),
        Node("bare", 8000, 65536, [Device(0, "nvidia", "A100", 81920)]),
        Node(
            "npu", 8000, 65536, [Device(0, "ascend", "Ascend910B", 65536)], labels={"stack.cann": "8.0.RC2"}
        ),
    ]
    state = ClusterState.from_nodes(nodes)
    state.rules = NodeConstraints([NodeRules(labels=n.labels) for n in nodes])

    def fits(**stacks: str) -> list[bool]:
        req = Request(gpu_count=1, gpu_milli=1000, stacks=tuple(sorted(stacks.items())))
        return state.eligible(req).tolist()

    assert fits(cuda="12.4") == [False, True, False, False]  # 12.10 is later than 12.4
    assert fits(cuda="12") == [True, True, False, False]
    assert fits(cann="8.0") == [False, False, False, True]
    assert fits(cann="8.0.RC3") == [False, False, False, False]
    assert fits() == [True, True, True, True]
    text = str(explain(state, Request(gpu_count=1, gpu_milli=1000, stacks=(("rocm", "6.2"),))))
    assert "4 software stack" in text and "no node provides rocm ≥ 6.2" in text, text
    with pytest.raises(InvalidInput) as e:
        Request(gpu_count=1, gpu_milli=1000, stacks=(("cuda", "twelve"),))
    assert e.value.where == "stacks"


def test_the_agent_labels_the_stacks_it_finds(tmp_path: Path) -> None:
    (tmp_path / "opt/rocm/.info").mkdir(parents=True)
    (tmp_path / "opt/rocm/.info/version").write_text("6.2.0-66\n")
    info = tmp_path / "usr/local/Ascend/ascend-toolkit/latest/aarch64-linux/ascend_toolkit_install.info"
    info.parent.mkdir(parents=True)
    info.write_text("package_name=Ascend-cann-toolkit\nversion=8.0.RC2\ninnerversion=V100R001C19\n")
    devices = [
        DeviceInfo(0, "amd", "MI300X", 196608, "amd-0"),
        DeviceInfo(1, "ascend", "Ascend910B", 65536, "ascend-1"),
    ]
    assert stack_labels(devices, root=tmp_path) == {"stack.rocm": "6.2.0", "stack.cann": "8.0.RC2"}
    assert stack_labels(devices, root=tmp_path / "nothing") == {}
    assert stack_labels([DeviceInfo(0, "simulated", "T4", 15360, "sim-0")], root=tmp_path) == {}


def test_stack_options_read_as_at_least() -> None:
    assert parse_stacks(["cuda-12.4", "ROCm>=6.2"], "--stack") == {"cuda": "12.4", "rocm": "6.2"}
    assert parse_stacks(None, "--stack") is None
    with pytest.raises(InvalidInput) as e:
        parse_stacks(["cuda"], "--stack")
    assert e.value.where == "--stack" and "cuda-12.4" in e.value.message
