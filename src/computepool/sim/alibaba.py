"""Loaders for the Alibaba GPU cluster trace 2023 ("openb"): node lists and pod lists."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from computepool.core.errors import InvalidInput
from computepool.core.quantities import MILLI_PER_DEVICE
from computepool.core.request import Request, parse_models
from computepool.core.resources import Device, Node
from computepool.sim.csvread import int_field, read_rows

# Device memory by model where it is public; G1–G3 are undisclosed internal codes.
MODEL_MEMORY_MIB = {
    "T4": 16 * 1024,
    "P100": 16 * 1024,
    "V100M16": 16 * 1024,
    "V100M32": 32 * 1024,
    "A10": 24 * 1024,
}


def load_nodes(path: str | Path) -> list[Node]:
    """One node per row of `sn,cpu_milli,memory_mib,gpu,model`."""
    nodes: list[Node] = []
    seen: set[str] = set()
    for where, row in read_rows(path, ["sn", "cpu_milli", "memory_mib", "gpu", "model"]):
        name = (row["sn"] or "").strip()
        if not name:
            raise InvalidInput(where, "column sn: empty node name")
        if name in seen:
            raise InvalidInput(where, f"column sn: duplicate node {name!r}")
        seen.add(name)
        cpu = int_field(row, "cpu_milli", where)
        mem = int_field(row, "memory_mib", where)
        gpus = int_field(row, "gpu", where)
        model = (row["model"] or "").strip()
        if gpus and not model:
            raise InvalidInput(where, "column model: empty for a node with GPUs")
        if model:
            models = parse_models(model, f"{where}: column model")
            if models is None or len(models) != 1:
                raise InvalidInput(where, f"column model: one model name expected, got {model!r}")
        devices = [
            Device(
                index=j,
                vendor="nvidia",
                model=model,
                memory_mib=MODEL_MEMORY_MIB.get(model, 0),
                uuid=f"{name}-gpu{j}",
            )
            for j in range(gpus)
        ]
        nodes.append(Node(name=name, cpu_milli=cpu, memory_mib=mem, devices=devices))
    if not nodes:
        raise InvalidInput(str(path), "no nodes in file")
    return nodes


@dataclass(frozen=True)
class Pod:
    name: str
    request: Request

    @property
    def gpu_milli_total(self) -> int:
        return self.request.gpu_count * self.request.gpu_milli


POD_COLUMNS = ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"]


def load_pods(path: str | Path) -> list[Pod]:
    """One request per row of the pod list; GPU memory is not part of the trace (0).

    Only `POD_COLUMNS` are required: the published FGD artifact's multi-GPU variants carry just
    those, so a missing `gpu_spec` means any model, and the timing columns are never read.
    """
    pods: list[Pod] = []
    cols = POD_COLUMNS
    for where, row in read_rows(path, cols):
        name = (row["name"] or "").strip()
        if not name:
            raise InvalidInput(where, "column name: empty pod name")
        cpu = int_field(row, "cpu_milli", where)
        mem = int_field(row, "memory_mib", where)
        num_gpu = int_field(row, "num_gpu", where)
        milli = int_field(row, "gpu_milli", where)
        if milli > MILLI_PER_DEVICE:
            raise InvalidInput(where, f"column gpu_milli: at most {MILLI_PER_DEVICE}, got {milli}")
        if num_gpu == 0:
            milli = 0
        elif milli == 0:
            raise InvalidInput(where, "column gpu_milli: 0 for a pod that asks for GPUs")
        models = parse_models(row.get("gpu_spec") or "", f"{where}: column gpu_spec")
        try:
            req = Request(
                gpu_count=num_gpu,
                gpu_milli=milli,
                gpu_memory_mib=0 if num_gpu else None,
                cpu_milli=cpu,
                memory_mib=mem,
                models=models,
                name=name,
            )
        except InvalidInput as e:
            raise InvalidInput(where, f"{e.where}: {e.message}") from None
        pods.append(Pod(name=name, request=req))
    if not pods:
        raise InvalidInput(str(path), "no pods in file")
    return pods
