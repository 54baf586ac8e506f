"""`cpool nodes`: the inventory, one row per device with a bar of its allocated share; cordon/drain;
placement rules (labels, taints, dedication to a tenant)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape

from computepool.cli.common import print_json
from computepool.cli.pool_cmd import (
    JsonOpt,
    ServerOpt,
    TokenOpt,
    cpus_text,
    open_client,
    pool_command,
    say,
    show,
    table,
)
from computepool.client import PoolClient, PoolError
from computepool.core.allocation import HOLDING
from computepool.core.errors import InvalidInput
from computepool.core.quantities import format_mib
from computepool.core.servers import ServerArg

BAR_WIDTH = 10
Usage = dict[tuple[str, int], tuple[int, int]]  # (node, device index) → (compute milli, memory MiB)


def bar(share: float, width: int = BAR_WIDTH) -> str:
    """`████░░░░░░  40%`: a text bar, so it reads the same on a terminal, in a log or a test."""
    share = min(max(share, 0.0), 1.0)
    full = round(share * width)
    return f"{'█' * full}{'░' * (width - full)} {share * 100:3.0f}%"


def allocated_by_device(pool: PoolClient, nodes: list[dict[str, Any]]) -> Usage | None:
    """Allocated compute and memory per device, or None when the server has no allocation info.

    Devices may carry `allocated_milli`/`allocated_memory_mib` themselves; otherwise the slices of
    the bound and active allocations the caller may see are added up.
    """
    usage: Usage = {}
    for n in nodes:
        for d in n.get("devices", []):
            milli = d.get("allocated_milli", d.get("allocated_compute_milli"))
            if milli is not None:
                usage[(n["name"], d["index"])] = (int(milli), int(d.get("allocated_memory_mib") or 0))
    if usage:
        return usage
    try:
        allocs = [a for state in HOLDING for a in pool.list_allocations(state=state)]
    except PoolError as e:
        if e.status in (404, 405):  # a server without the allocations API
            return None
        raise
    for a in allocs:
        for s in a.get("slices") or []:
            key = (s["node"], s["device_index"])
            milli, mem = usage.get(key, (0, 0))
            usage[key] = (milli + int(s.get("compute_milli") or 0), mem + int(s.get("memory_mib") or 0))
    return usage


def _state(n: dict[str, Any]) -> str:
    colour = {"ready": "green", "suspect": "yellow", "lost": "red"}.get(n["state"], "white")
    flags = " draining" if n.get("draining") else (" cordoned" if n.get("cordoned") else "")
    return f"[{colour}]{n['state']}[/{colour}]{flags}"


def rules_text(n: dict[str, Any]) -> str:
    """`gpu=a100; taint team=ml; dedicated to ml (no lending)`: what steers work to or off a node."""
    parts = [",".join(f"{k}={v}" for k, v in sorted((n.get("labels") or {}).items()))]
    taints = n.get("taints") or {}
    if taints:
        parts.append("taint " + ",".join(f"{k}={v}" if v else k for k, v in sorted(taints.items())))
    if n.get("dedicated"):
        owner = n.get("dedicated_to") or "another tenant"
        parts.append(f"dedicated to {owner}" + ("" if n.get("lending", True) else " (no lending)"))
    return "; ".join(p for p in parts if p)


def parse_changes(items: list[str], field: str) -> dict[str, str | None]:
    """`["gpu=a100", "zone-"]` → {"gpu": "a100", "zone": None}: KEY=VALUE sets, KEY- removes."""
    out: dict[str, str | None] = {}
    for item in items:
        if "=" in item:
            key, _, value = item.partition("=")
            out[key.strip()] = value.strip()
        elif item.endswith("-") and len(item) > 1:
            out[item[:-1].strip()] = None
        else:
            raise InvalidInput(field, f"expected KEY=VALUE to set or KEY- to remove, got {item!r}")
        if not list(out)[-1]:
            raise InvalidInput(field, f"empty key in {item!r}")
    return out


def show_nodes(nodes: list[dict[str, Any]], usage: Usage | None) -> None:
    if not nodes:
        say("no nodes: join one with `cpool join-token` and an agent")
        return
    with_rules = any(rules_text(n) for n in nodes)
    cols = [
        "node",
        "state",
        "address",
        *(["labels / rules"] if with_rules else []),
        "cpu / mem",
        "dev",
        "model",
        "memory",
    ]
    cols += ["allocated compute", "allocated memory"] if usage is not None else ["uuid"]
    t = table(None, *cols)
    for n in nodes:
        head = [escape(n["name"]), _state(n), escape(n.get("address") or "")]
        head += [escape(rules_text(n))] if with_rules else []
        head.append(f"{cpus_text(n['cpu_milli'])} / {format_mib(n['memory_mib'])}")
        devices = n.get("devices") or []
        if not devices:
            t.add_row(*head, "-", "cpu only", "", *([""] * (len(cols) - len(head) - 3)))
        for i, d in enumerate(devices):
            row = [*(head if i == 0 else [""] * len(head)), str(d["index"]), escape(d["model"])]
            row.append(format_mib(d["memory_mib"]))
            if usage is not None:
                milli, mem = usage.get((n["name"], d["index"]), (0, 0))
                row += [
                    bar(milli / max(d.get("compute_milli") or 1000, 1)),
                    bar(mem / max(d["memory_mib"], 1)),
                ]
            else:
                row.append(escape(d.get("uuid") or ""))
            t.add_row(*row)
    show(t)


def register(app: typer.Typer) -> None:
    nodes = typer.Typer(
        help="Nodes of the pool: list (the default), cordon, uncordon, drain, label, taint, dedicate."
    )
    app.add_typer(nodes, name="nodes")

    def list_nodes(server: ServerArg, token: str | None, json_out: bool) -> None:
        with open_client(server, token) as pool:
            items = pool.list_nodes()
            if json_out:
                print_json(items)
                return
            usage = allocated_by_device(pool, items)
        show_nodes(items, usage)

    @nodes.callback(invoke_without_command=True)
    @pool_command
    def default(
        ctx: typer.Context, server: ServerOpt = None, token: TokenOpt = None, json_out: JsonOpt = False
    ) -> None:
        """Without a subcommand: the same as `cpool nodes list`."""
        if ctx.invoked_subcommand is None:
            list_nodes(server, token, json_out)

    @nodes.command("list")
    @pool_command
    def list_(server: ServerOpt = None, token: TokenOpt = None, json_out: JsonOpt = False) -> None:
        """Every node with its devices: allocated share when the server reports it, else capacity."""
        list_nodes(server, token, json_out)

    def flag_command(verb: str, doc: str) -> None:
        @nodes.command(verb, help=doc)
        @pool_command
        def change(
            name: Annotated[str, typer.Argument(help="Node name.")],
            server: ServerOpt = None,
            token: TokenOpt = None,
            json_out: JsonOpt = False,
        ) -> None:
            with open_client(server, token) as pool:
                out = getattr(pool, verb)(name)
            if json_out:
                print_json(out)
                return
            flags = (
                "draining" if out.get("draining") else ("cordoned" if out.get("cordoned") else "schedulable")
            )
            say(f"node {out['name']}: {flags} ({out['state']})")

    flag_command("cordon", "Place no new work on the node (admin).")
    flag_command("uncordon", "Let work be placed on the node again (admin).")
    flag_command(
        "drain", "Cordon the node; restartable work moves elsewhere, the rest finishes there (admin)."
    )

    def rules_command(verb: str, doc: str, build: Any) -> None:
        """A command that PATCHes the node's rules and says what they are now."""

        @nodes.command(verb, help=doc)
        @pool_command
        def change(
            name: Annotated[str, typer.Argument(help="Node name.")],
            items: Annotated[list[str], typer.Argument(help="KEY=VALUE to set, KEY- to remove.")],
            server: ServerOpt = None,
            token: TokenOpt = None,
            json_out: JsonOpt = False,
        ) -> None:
            patch = build(items)
            with open_client(server, token) as pool:
                out = pool.update_node(name, **patch)
            if json_out:
                print_json(out)
                return
            say(f"node {out['name']}: {rules_text(out) or 'no labels, taints or dedication'}")

    rules_command(
        "label",
        "Set (KEY=VALUE) or remove (KEY-) node labels; requests select them with --node-selector (admin).",
        lambda items: {"labels": parse_changes(items, "labels")},
    )
    rules_command(
        "taint",
        "Keep work off the node unless it tolerates KEY=VALUE (--toleration); KEY- removes (admin).",
        lambda items: {"taints": parse_changes(items, "taints")},
    )

    @nodes.command("dedicate")
    @pool_command
    def dedicate(
        name: Annotated[str, typer.Argument(help="Node name.")],
        tenant: Annotated[str, typer.Option("--tenant", help="The tenant the node is set aside for.")],
        lending: Annotated[
            bool,
            typer.Option(
                "--lending/--no-lending",
                help="Let other tenants borrow it as preemptible work (default), or keep them off.",
            ),
        ] = True,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Set the node aside for one tenant; others borrow it preemptibly, or never (admin).

        The tenant's work goes there first and takes it back from borrowers (restartable ones
        are requeued); with --no-lending nobody else is placed there.
        """
        with open_client(server, token) as pool:
            out = pool.update_node(name, dedicated_to=tenant, lending=lending)
        if json_out:
            print_json(out)
            return
        say(f"node {out['name']}: {rules_text(out)}")

    @nodes.command("undedicate")
    @pool_command
    def undedicate(
        name: Annotated[str, typer.Argument(help="Node name.")],
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Share the node with every tenant again (admin)."""
        with open_client(server, token) as pool:
            out = pool.update_node(name, dedicated_to=None, lending=True)
        if json_out:
            print_json(out)
            return
        say(f"node {out['name']}: shared ({rules_text(out) or 'no labels, taints or dedication'})")
