"""Shared fixtures: the real Alibaba trace (read once per session) and tiny CSV files."""

from __future__ import annotations

from pathlib import Path

import pytest

from computepool.core import Node
from computepool.sim.alibaba import Pod, load_nodes, load_pods
from computepool.sim.csvread import traces_dir

NODE_HEADER = "sn,cpu_milli,memory_mib,gpu,model"
POD_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,"
    "qos,pod_phase,creation_time,deletion_time,scheduled_time"
)


@pytest.fixture(scope="session")
def alibaba_dir() -> Path:
    d = traces_dir() / "alibaba-v2023"
    if not (d / "openb_node_list_gpu_node.csv").exists():
        pytest.skip(f"Alibaba trace not found under {d} (set CPOOL_TRACES)")
    return d


@pytest.fixture(scope="session")
def gpu_nodes(alibaba_dir: Path) -> list[Node]:
    return load_nodes(alibaba_dir / "openb_node_list_gpu_node.csv")


@pytest.fixture(scope="session")
def default_pods(alibaba_dir: Path) -> list[Pod]:
    return load_pods(alibaba_dir / "openb_pod_list_default.csv")


def pod_row(
    name: str, cpu: int = 1000, mem: int = 1024, num_gpu: int = 1, milli: int = 500, spec: str = ""
) -> str:
    return f"{name},{cpu},{mem},{num_gpu},{milli},{spec},LS,Running,0,10,0"


@pytest.fixture
def tiny_csvs(tmp_path: Path) -> tuple[Path, Path]:
    """A 3-node cluster (2 GPUs each, two models) and a dozen mixed pods."""
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(
        "\n".join(
            [
                NODE_HEADER,
                "node-a,32000,131072,2,T4",
                "node-b,32000,131072,2,T4",
                "node-c,64000,262144,2,V100M32",
            ]
        )
        + "\n"
    )
    pods = tmp_path / "pods.csv"
    rows = [
        pod_row("p00", milli=500),
        pod_row("p01", milli=500),
        pod_row("p02", milli=250),
        pod_row("p03", milli=810),
        pod_row("p04", milli=1000),
        pod_row("p05", num_gpu=2, milli=1000, cpu=8000),
        pod_row("p06", num_gpu=0, milli=0, cpu=4000),
        pod_row("p07", milli=300, spec="V100M32"),
        pod_row("p08", milli=100),
        pod_row("p09", milli=700, spec="T4|V100M32"),
        pod_row("p10", milli=1000, spec="T4"),
        pod_row("p11", milli=200),
    ]
    pods.write_text("\n".join([POD_HEADER, *rows]) + "\n")
    return nodes, pods
