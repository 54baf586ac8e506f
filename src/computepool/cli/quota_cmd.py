"""`cpool quota`: what each tenant is guaranteed and may at most use, read and set over HTTP."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer

from computepool.cli.common import print_json
from computepool.cli.pool_cmd import (
    JsonOpt,
    ServerOpt,
    TokenOpt,
    cpus_text,
    gpus_text,
    open_client,
    pool_command,
    say,
    show,
    table,
)
from computepool.core.errors import InvalidInput
from computepool.core.quantities import format_mib, parse_cpu_milli, parse_memory_mib


def _gpu_total_milli(text: str, field: str) -> int:
    """Quota GPUs are a total, so 1.5 GPUs is fine here (unlike a request, where a slice is on one device)."""
    try:
        return parse_cpu_milli(text, field)
    except InvalidInput:
        raise InvalidInput(field, f"cannot read GPUs {text!r} (use e.g. 2, 0.5 or 1500m)") from None


def _pair(quota: dict[str, Any], key: str, guaranteed: int | None, limit: int | None, flag: str) -> None:
    if guaranteed is None and limit is None:
        return
    g = guaranteed if guaranteed is not None else 0
    lim = limit if limit is not None else max(g, 0)
    if lim < g:
        raise InvalidInput(f"{flag}-limit", f"limit is below the guaranteed amount given with {flag}")
    quota[key] = {"guaranteed": g, "limit": lim}


def _quota_rows(quota: dict[str, Any]) -> list[tuple[str, str, str]]:
    fmt: dict[str, Callable[[int], str]] = {
        "gpu_milli": gpus_text,
        "gpu_memory_mib": format_mib,
        "cpu_milli": cpus_text,
        "memory_mib": format_mib,
    }
    names = {"gpu_milli": "GPUs", "gpu_memory_mib": "GPU memory", "cpu_milli": "CPUs", "memory_mib": "memory"}
    rows = []
    for key, f in fmt.items():
        pair = quota.get(key)
        if pair:
            rows.append((names[key], f(pair["guaranteed"]), f(pair["limit"])))
    for model, mq in sorted((quota.get("models") or {}).items()):
        for key in ("gpu_milli", "gpu_memory_mib"):
            pair = mq.get(key)
            if pair:
                rows.append(
                    (f"{names[key]} ({model})", fmt[key](pair["guaranteed"]), fmt[key](pair["limit"]))
                )
    return rows


def register(app: typer.Typer) -> None:
    _register_quota(app)


def _register_quota(app: typer.Typer) -> None:
    quota = typer.Typer(no_args_is_help=True, help="Tenant quotas: guaranteed and limit per resource.")
    app.add_typer(quota, name="quota")

    def show_quota(tenant: str, q: dict[str, Any]) -> None:
        rows = _quota_rows(q)
        if not rows:
            say(f"tenant {tenant} has no quota: nothing guaranteed, no limit but the pool")
            return
        t = table(f"quota of {tenant}", "resource", "guaranteed", "limit")
        for r in rows:
            t.add_row(*r)
        show(t)

    @quota.command("get")
    @pool_command
    def get(
        tenant: Annotated[str, typer.Argument(help="Tenant name.")],
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Show a tenant's quota."""
        with open_client(server, token) as pool:
            q = pool.get_quota(tenant)
        if json_out:
            print_json(q)
        else:
            show_quota(tenant, q)

    @quota.command("set")
    @pool_command
    def set_(
        tenant: Annotated[str, typer.Argument(help="Tenant name.")],
        gpus: Annotated[str | None, typer.Option("--gpus", help="Guaranteed GPUs, e.g. 2 or 0.5.")] = None,
        gpus_limit: Annotated[str | None, typer.Option("--gpus-limit", help="Most GPUs it may hold.")] = None,
        gpu_mem: Annotated[
            str | None, typer.Option("--gpu-mem", help="Guaranteed GPU memory, e.g. 80GiB.")
        ] = None,
        gpu_mem_limit: Annotated[str | None, typer.Option("--gpu-mem-limit")] = None,
        cpus: Annotated[str | None, typer.Option("--cpus", help="Guaranteed CPUs, e.g. 16 or 500m.")] = None,
        cpus_limit: Annotated[str | None, typer.Option("--cpus-limit")] = None,
        mem: Annotated[str | None, typer.Option("--mem", help="Guaranteed host memory, e.g. 64GiB.")] = None,
        mem_limit: Annotated[str | None, typer.Option("--mem-limit")] = None,
        replace: Annotated[
            bool, typer.Option("--replace", help="Drop the resources not given (default: keep them).")
        ] = False,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Set quota resources (admin). A limit left out equals the guaranteed amount."""
        updates: dict[str, Any] = {}
        specs: list[tuple[str, str, str | None, str | None, Callable[[str, str], int]]] = [
            ("gpu_milli", "--gpus", gpus, gpus_limit, _gpu_total_milli),
            ("gpu_memory_mib", "--gpu-mem", gpu_mem, gpu_mem_limit, parse_memory_mib),
            ("cpu_milli", "--cpus", cpus, cpus_limit, parse_cpu_milli),
            ("memory_mib", "--mem", mem, mem_limit, parse_memory_mib),
        ]
        for key, flag, g, lim, parse in specs:
            g_val = None if g is None else parse(g, flag)
            lim_val = None if lim is None else parse(lim, f"{flag}-limit")
            _pair(updates, key, g_val, lim_val, flag)
        if not updates and not replace:
            raise InvalidInput("quota set", "nothing to set (give --gpus, --gpu-mem, --cpus or --mem)")
        with open_client(server, token) as pool:
            current = {} if replace else pool.get_quota(tenant)
            q = pool.set_quota(tenant, {**current, **updates})
        if json_out:
            print_json(q)
        else:
            show_quota(tenant, q)
