"""The request options in human units (`gpus=0.5`, `mem="8GiB"`, `time_limit="1h"`), parsed once.

`cpool alloc`, `cpool run` and the SDK's `Pool.function(...)` all build their request here, so an
option means the same thing, and is refused with the same message, wherever it is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from computepool.core.allocation import ISOLATIONS
from computepool.core.errors import InvalidInput
from computepool.core.images import parse_image
from computepool.core.quantities import parse_cpu_milli, parse_duration_s, parse_gpu_milli, parse_memory_mib
from computepool.core.vendors import VENDORS

if TYPE_CHECKING:  # the wire's models load pydantic: not at the CLI's start-up
    from computepool.wire.allocations import AllocationCreate

Quantity = str | int | float


def build_request(
    *,
    gpus: Quantity = 0,
    gpu_mem: Quantity | None = None,
    cpus: Quantity = 0,
    mem: Quantity = 0,
    exclusive: bool = False,
    model: str | Sequence[str] | None = None,
    isolation: str | None = None,
    image: str | None = None,
    ports: Sequence[int] | None = None,
    mig: str | None = None,
    node_selector: Sequence[str] | Mapping[str, str] | None = None,
    tolerations: Sequence[str] | None = None,
    time_limit: Quantity | None = None,
    nodes: int = 1,
    colocate: str | None = None,
    vendor: str | Sequence[str] | None = None,
    min_gpu_mem: Quantity | None = None,
    accelerator: str | None = None,
    stack: str | Sequence[str] | None = None,
    flag: str = "--",
    **extra: Any,
) -> AllocationCreate:
    """The request body from human-unit options. `flag` prefixes the option names in errors
    (`--gpus` for the CLI, `gpus` for the SDK). Quantities are per node; `nodes` > 1 is a gang."""

    def name(opt: str) -> str:
        return flag + (opt if flag == "--" else opt.replace("-", "_"))

    count, milli = parse_gpu_milli(str(gpus), name("gpus"))
    if count == 0 and (mig is not None or isolation == "mig"):
        count, milli = 1, 1000  # a MIG instance is one device
    specs = [model] if isinstance(model, str) else list(model or [])
    models = [m.strip() for spec in specs for m in spec.replace(",", "|").split("|") if m.strip()]
    if isolation is not None and isolation not in ISOLATIONS:
        raise InvalidInput(
            name("isolation"), f"unknown mode {isolation!r} (choose from {', '.join(ISOLATIONS)})"
        )
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise InvalidInput(name("nodes"), f"must be a whole number of nodes, 1 or more, got {nodes!r}")
    if image is not None:  # before any upload: a transport or a path is never sent
        parse_image(image, name("image"))
    selector = (
        {str(k): str(v) for k, v in node_selector.items()} or None
        if isinstance(node_selector, Mapping)
        else parse_selector(node_selector, name("node-selector"))
    )
    vendors = parse_vendors(vendor, accelerator, name("vendor"), name("accelerator"))
    from computepool.wire.allocations import AllocationCreate  # noqa: PLC0415 (pydantic, on first use)

    return AllocationCreate.unchecked(
        gpus=count,
        gpu_milli=milli or 1000,
        gpu_memory_mib=parse_memory_mib(gpu_mem, name("gpu-mem")) if gpu_mem else None,
        cpu_milli=parse_cpu_milli(cpus, name("cpus")),
        memory_mib=parse_memory_mib(mem, name("mem")),
        models=models or None,
        exclusive=exclusive,
        isolation=isolation,  # checked against ISOLATIONS above
        image=image,
        ports=list(ports) if ports else None,
        mig=mig,
        node_selector=selector,
        tolerations=parse_tolerations(tolerations, name("toleration")),
        time_limit=parse_duration_s(time_limit, name("time-limit")) if time_limit is not None else None,
        gang_nodes=nodes,
        colocate=colocate or None,
        vendors=vendors,
        stacks=parse_stacks(stack, name("stack")),
        min_gpu_memory_mib=parse_memory_mib(min_gpu_mem, name("min-gpu-mem")) if min_gpu_mem else None,
        **extra,
    )


def parse_stacks(items: str | Sequence[str] | None, field: str) -> dict[str, str] | None:
    """`["cuda-12.4", "rocm>=6.2"]` → {"cuda": "12.4", "rocm": "6.2"}: at least these versions."""
    specs = [items] if isinstance(items, str) else list(items or [])
    out: dict[str, str] = {}
    for spec in specs:
        text = str(spec).strip().lower()
        name, sep, version = text.partition(">=")
        if not sep:
            name, sep, version = text.partition("-")
        if not sep or not name or not version:
            raise InvalidInput(field, f"expected NAME-VERSION such as cuda-12.4 or rocm>=6.2, got {spec!r}")
        out[name.strip()] = version.strip()
    return out or None


def parse_vendors(
    vendor: str | Sequence[str] | None, accelerator: str | None, field: str, accel_field: str
) -> list[str] | None:
    """`--vendor amd,nvidia` (or repeated) → the vendors allowed; `--accelerator any` says any
    vendor will do (the default) and `--accelerator amd` is `--vendor amd`. None: any."""
    specs = [vendor] if isinstance(vendor, str) else list(vendor or [])
    if accelerator is not None and accelerator.strip().lower() != "any":
        if specs:
            raise InvalidInput(accel_field, f"{accelerator!r} contradicts {field}: give one of them")
        specs, field = [accelerator], accel_field
    names = [v.strip().lower() for spec in specs for v in spec.replace("|", ",").split(",") if v.strip()]
    for v in names:
        if v not in VENDORS:
            raise InvalidInput(field, f"unknown vendor {v!r} (choose from {', '.join(VENDORS)}, or any)")
    return sorted(set(names)) or None


def parse_secrets(items: Sequence[str] | None, field: str = "--secret") -> list[dict[str, str]] | None:
    """`["HF_TOKEN", "HF_TOKEN=VAR"]` → a request's `secrets` (the server checks names and variables)."""
    if isinstance(items, str):
        raise InvalidInput(field, f"expected a list of NAME or NAME=VARIABLE, not the string {items!r}")
    uses: list[dict[str, str]] = []
    for item in items or []:
        name, eq, var = str(item).partition("=")
        if not name or (eq and not var):
            raise InvalidInput(field, f"expected NAME or NAME=VARIABLE, got {item!r}")
        uses.append({"name": name, "env": var} if eq else {"name": name})
    return uses or None


def parse_selector(items: Sequence[str] | None, field: str = "--node-selector") -> dict[str, str] | None:
    """`["gpu=a100", "zone=b"]` → {"gpu": "a100", "zone": "b"}; each item must be KEY=VALUE."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InvalidInput(field, f"expected KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out or None


def parse_tolerations(items: Sequence[str] | None, field: str = "--toleration") -> list[str] | None:
    """`["gpu=reserved", "maintenance"]`: KEY=VALUE, or a bare KEY for any value (the server checks
    the characters and names the item it refuses)."""
    out = []
    for item in items or []:
        key, sep, value = item.strip().partition("=")
        if not key.strip():
            raise InvalidInput(field, f"expected KEY=VALUE or KEY, got {item!r}")
        out.append(f"{key.strip()}={value.strip()}" if sep else key.strip())
    return out or None
