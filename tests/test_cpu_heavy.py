"""Mixes heavier in CPU-only work: the synthesized variants, where `default` puts CPU-only
requests, and a fill-up of a CPU-heavier Alibaba variant on a slice of the cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from computepool.core import Device, InvalidInput, Node, Request
from computepool.scheduler.fragmentation import TypicalPods
from computepool.scheduler.placement import Scheduler
from computepool.scheduler.policies import DefaultScorer, FGDScorer, idle_gpu_tiebreak
from computepool.scheduler.state import Change, ClusterState
from computepool.sim.alibaba import Pod, load_nodes, load_pods
from computepool.sim.fill import run_fill
from computepool.sim.variants import scale_cpu_only


def _node(name: str, gpus: int, cpu: int = 64000) -> Node:
    return Node(name, cpu, 262144, [Device(j, "nvidia", "T4", 16384) for j in range(gpus)])


def test_scale_cpu_only_multiplies_only_the_cpu_only_pods() -> None:
    pods = [Pod(f"c{i}", Request(cpu_milli=1000 * (i + 1))) for i in range(4)]
    pods += [Pod(f"g{i}", Request(gpu_count=1, gpu_milli=500, cpu_milli=2000)) for i in range(3)]
    for factor, cpu_only in ((1.0, 4), (1.5, 6), (2.0, 8), (2.5, 10)):
        out = scale_cpu_only(pods, factor, seed=7)
        assert sum(p.request.gpu_count == 0 for p in out) == cpu_only
        assert [p for p in out if p.request.gpu_count] == pods[4:]  # GPU pods untouched
        assert len({p.name for p in out}) == len(out)  # copies have names of their own
        assert all(p.name == p.request.name for p in out if p not in pods)
    assert scale_cpu_only(pods, 2.5, seed=7) == scale_cpu_only(pods, 2.5, seed=7)
    with pytest.raises(InvalidInput, match="--cpu-only-scale"):
        scale_cpu_only(pods, 0.5)


def test_cpu_only_work_goes_where_the_gpus_are_in_use() -> None:
    """FGD scores both nodes alike for a CPU-only request (taking 4 of 64 cores strands no GPU)
    and takes the lowest index; `default` leaves the CPUs of the node with idle GPUs to the GPU
    work that will need them."""
    state = ClusterState.from_nodes([_node("idle-gpus", 2), _node("gpus-in-use", 2)])
    held = {0: 1000, 1: 1000}
    state.apply(
        Change(node=1, cpu_milli=2000, memory_mib=0, gpu_milli=held, gpu_memory_mib=dict(held), tag=2)
    )
    cpu_only = Request(cpu_milli=4000)
    typical = TypicalPods.from_requests([cpu_only, Request(gpu_count=1, gpu_milli=1000, cpu_milli=1000)])
    fgd = Scheduler(FGDScorer(typical)).place(state, cpu_only)
    assert fgd.placements[0].node == 0
    d = Scheduler(DefaultScorer()).place(state, cpu_only)
    assert d.ok and d.placements[0].node == 1
    assert idle_gpu_tiebreak(state.node_view()).tolist() == [0.5 / 3, 0.5]
    no_gpus = ClusterState.from_nodes([_node("cpu-only", 0)])
    assert idle_gpu_tiebreak(no_gpus.node_view()).tolist() == [0.5]  # CPU-only nodes first


def test_cpu_only_work_goes_where_the_fewest_gpus_are_idle() -> None:
    """Counted in devices, not as a share of the node's: one idle GPU of one is less to strand
    than four idle of eight, although the first node has none of its GPUs in use."""
    state = ClusterState.from_nodes([_node("eight", 8), _node("one", 1)])
    held = {j: 1000 for j in range(4)}
    state.apply(
        Change(node=0, cpu_milli=2000, memory_mib=0, gpu_milli=held, gpu_memory_mib=dict(held), tag=4)
    )
    d = Scheduler(DefaultScorer()).place(state, Request(cpu_milli=4000))
    assert d.ok and d.placements[0].node == 1
    assert d.placements[0].score == 50 + 0.5 / 2  # tied on FGD's 50; the tie-break decides


@pytest.fixture(scope="module")
def cpu_heavy(alibaba_dir: Path) -> tuple[list[Node], list[Pod]]:
    """Every 6th node and every 6th pod of cpu100, its CPU-only pods ×2.5."""
    nodes = load_nodes(alibaba_dir / "openb_node_list_gpu_node.csv")[::6]
    pods = load_pods(alibaba_dir / "openb_pod_list_cpu100.csv")[::6]
    return nodes, scale_cpu_only(pods, 2.5)


@pytest.mark.parametrize("seed", [1, 2])
def test_default_on_a_cpu_heavier_mix_leaves_fewer_gpus_idle_than_bestfit(cpu_heavy, seed: int) -> None:
    nodes, pods = cpu_heavy
    got = run_fill(nodes, pods, "default", seed, offline=False)
    base = run_fill(nodes, pods, "bestfit", seed, offline=False)
    assert got.pods_arrived == base.pods_arrived
    assert got.unallocated_pct_at_100 <= base.unallocated_pct_at_100
