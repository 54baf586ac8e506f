"""Pod lists as the published FGD artifact ships them: multi-GPU variants with five columns only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from computepool.cli import main as cli_main
from computepool.core import InvalidInput
from computepool.sim.alibaba import POD_COLUMNS, load_pods

FIVE = "name,cpu_milli,memory_mib,num_gpu,gpu_milli"
ROWS = [
    "openb-pod-0000,88000,327680,8,1000",
    "openb-pod-0001,32000,131072,4,1000",
    "openb-pod-0002,16000,65536,2,1000",
    "openb-pod-0003,8000,30517,1,460",
    "openb-pod-0004,12500,51200,0,0",
]


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_five_column_pod_list_loads_with_defaults(tmp_path: Path) -> None:
    assert FIVE.split(",") == POD_COLUMNS
    pods = load_pods(write(tmp_path / "openb_pod_list_multigpu50.csv", [FIVE, *ROWS]))
    assert [p.name for p in pods] == [r.split(",")[0] for r in ROWS]
    by = {p.name: p.request for p in pods}
    assert (by["openb-pod-0000"].gpu_count, by["openb-pod-0000"].gpu_milli) == (8, 1000)
    assert by["openb-pod-0000"].cpu_milli == 88000 and by["openb-pod-0000"].memory_mib == 327680
    assert by["openb-pod-0003"].fractional and by["openb-pod-0003"].gpu_milli == 460
    assert by["openb-pod-0004"].gpu_count == 0
    assert all(r.models is None for r in by.values())  # no gpu_spec: any model


def test_columns_in_another_order_and_extra_ones(tmp_path: Path) -> None:
    path = write(
        tmp_path / "pods.csv", ["gpu_milli,num_gpu,name,memory_mib,cpu_milli,note", "1000,2,p,1024,4000,x"]
    )
    (p,) = load_pods(path)
    assert (p.request.gpu_count, p.request.cpu_milli) == (2, 4000)


@pytest.mark.parametrize("missing", ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"])
def test_each_of_the_five_is_still_required(tmp_path: Path, missing: str) -> None:
    cols = [c for c in FIVE.split(",") if c != missing]
    path = write(tmp_path / "pods.csv", [",".join(cols), ",".join("1" for _ in cols)])
    with pytest.raises(InvalidInput) as e:
        load_pods(path)
    assert e.value.where == f"{path}:1" and f"missing column(s) {missing}" in str(e.value)


def test_fill_runs_on_a_five_column_list(tmp_path: Path) -> None:
    nodes = write(
        tmp_path / "nodes.csv",
        ["sn,cpu_milli,memory_mib,gpu,model", "n0,128000,786432,8,V100M32", "n1,96000,786432,8,T4"],
    )
    pods = write(tmp_path / "openb_pod_list_multigpu50.csv", [FIVE, *ROWS])
    if not any(c.name == "fill" for c in cli_main.sim_app.registered_commands):
        cli_main._register()
    res = CliRunner().invoke(
        cli_main.app,
        [
            "sim",
            "fill",
            "--cluster",
            str(nodes),
            "--workload",
            str(pods),
            "--policy",
            "fgd",
            "--json",
            "--no-curve",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["workload"] == "multigpu50" and out["pods_arrived"] >= len(ROWS)
    assert out["energy"]["at_end"]["devices"] == 16
