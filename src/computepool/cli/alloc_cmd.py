"""`cpool alloc`, `release`, `cancel`, `ps`, `explain`, `logs`: asking for devices, giving them back."""

from __future__ import annotations

import signal
import time
from contextlib import AbstractContextManager, nullcontext, suppress
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.text import Text

from computepool.cli.common import err_console, fail, print_json
from computepool.cli.pool_cmd import (
    JsonOpt,
    ServerOpt,
    TokenOpt,
    cpus_text,
    gpus_text,
    open_client,
    pool_command,
    say,
    short_time,
    show,
    table,
)
from computepool.client import PoolClient, PoolError, ServerUnreachable
from computepool.client.http import ENDED_STATES
from computepool.client.options import build_request
from computepool.core.allocation import HOLDING, LIVE, PENDING
from computepool.core.quantities import (
    format_amount,
    format_duration,
    format_mib,
    resource_name,
)

if TYPE_CHECKING:  # the wire's models load pydantic: not at the CLI's start-up
    from computepool.wire.allocations import AllocationCreate

POLL_S = 0.5


def state_text(a: dict[str, Any]) -> str:
    """The state, with the time left for a bound or active allocation that has a time limit."""
    limit = (a.get("request") or {}).get("time_limit")
    if not limit or a.get("state") not in HOLDING or not a.get("bound_at"):
        return str(a.get("state"))
    try:
        bound = datetime.fromisoformat(str(a["bound_at"]))
    except ValueError:
        return str(a.get("state"))
    left = int(limit) - (datetime.now(UTC) - bound.astimezone(UTC)).total_seconds()
    return f"{a['state']} ({format_duration(max(0, round(left)))} left)"


# The request options `cpool alloc` and `cpool run` share (parsed by `request_from_options`).
GpusOpt = Annotated[
    str,
    typer.Option(
        "--gpus",
        "--gpus-per-node",
        help="Per node: 0.5 (a slice of one GPU), 1, 2, … or 250m; 0 for CPU only.",
    ),
]
GpuMemOpt = Annotated[str | None, typer.Option("--gpu-mem", help="GPU memory per device, e.g. 10GiB.")]
CpusOpt = Annotated[str, typer.Option("--cpus", help="Host CPUs per node, e.g. 2 or 500m.")]
MemOpt = Annotated[str, typer.Option("--mem", help="Host memory per node, e.g. 4GiB.")]
NodesOpt = Annotated[
    int,
    typer.Option(
        "--nodes",
        "--gang-nodes",
        min=1,
        help="Nodes, bound all-or-nothing and started together as one gang (each told MASTER_ADDR, "
        "MASTER_PORT, NODE_RANK, WORLD_SIZE …); the other quantities are per node.",
    ),
]
ExclusiveOpt = Annotated[bool, typer.Option("--exclusive", help="Whole devices, alone.")]
ModelOpt = Annotated[
    list[str] | None,
    typer.Option("--gpu-model", "--model", help="Acceptable GPU models (repeat, or MI300X,A100)."),
]
VendorOpt = Annotated[
    list[str] | None,
    typer.Option("--vendor", help="Acceptable device vendors: nvidia, amd, intel, ascend, apple (repeat)."),
]
MinGpuMemOpt = Annotated[
    str | None, typer.Option("--min-gpu-mem", help="Only devices with at least this much memory, e.g. 40GiB.")
]
StackOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--stack", help="A software stack the node must have, at least this version: cuda-12.4 (repeat)."
    ),
]
JobTypeOpt = Annotated[
    str | None,
    typer.Option(
        "--job-type",
        help="What kind of work this is (e.g. resnet50): placed on the device model its jobs ran fastest on.",
    ),
]
AcceleratorOpt = Annotated[
    str | None, typer.Option("--accelerator", help="any (the default: any vendor's device), or a vendor.")
]
IsolationOpt = Annotated[str | None, typer.Option("--isolation", help="timeslice, mps, mig or exclusive.")]
ImageOpt = Annotated[
    str | None, typer.Option("--image", help="Run in this OCI image (podman), e.g. localhost/pybase:1.")
]
PortOpt = Annotated[list[int] | None, typer.Option("--port", help="Container port to publish (repeat).")]
MigOpt = Annotated[str | None, typer.Option("--mig", help="A MIG instance of this profile, e.g. 1g.10gb.")]
SelectorOpt = Annotated[
    list[str] | None, typer.Option("--node-selector", help="Only nodes labelled KEY=VALUE (repeat).")
]
TolerationOpt = Annotated[
    list[str] | None,
    typer.Option("--toleration", help="May go on nodes tainted KEY=VALUE, or KEY with any value (repeat)."),
]
TimeLimitOpt = Annotated[
    str | None, typer.Option("--time-limit", help="End it after this long, e.g. 90m or 2h.")
]
ColocateOpt = Annotated[
    str | None,
    typer.Option(
        "--colocate",
        help="A gang's nodes must all share one value of this node label, e.g. rack (waits otherwise).",
    ),
]
NameOpt = Annotated[
    str | None,
    typer.Option(
        "--name",
        help="A label for people, not unique: lowercase letters, digits, '.', '_' and '-', starting with "
        "a letter or digit, at most 63 characters (so `hold-t4`, not `holdT4`).",
    ),
]
PriorityOpt = Annotated[int, typer.Option("--priority", help="Higher goes first.")]
TenantOpt = Annotated[str | None, typer.Option("--tenant", help="Admins: on behalf of a tenant.")]


def request_text(req: dict[str, Any]) -> str:
    """`2×0.5 GPU (10GiB), 4 CPUs, 16GiB` — the request as a person would say it."""
    parts = []
    gpus = int(req.get("gpus") or 0)
    if gpus:
        milli = int(req.get("gpu_milli") or 1000)
        g = f"{gpus} GPU{'s' if gpus > 1 else ''}" if milli == 1000 else f"{gpus}×{gpus_text(milli)} GPU"
        if req.get("gpu_memory_mib"):
            g += f" ({format_mib(req['gpu_memory_mib'])})"
        if req.get("models"):
            g += f" [{'|'.join(req['models'])}]"
        if req.get("vendors"):
            g += f" [{'|'.join(req['vendors'])}]"
        if req.get("min_gpu_memory_mib"):
            g += f" [≥{format_mib(req['min_gpu_memory_mib'])}]"
        if req.get("exclusive"):
            g += " exclusive"
        if req.get("job_type"):
            g += f" ({req['job_type']})"
        parts.append(g)
    if req.get("cpu_milli"):
        cpus = cpus_text(req["cpu_milli"])
        parts.append(f"{cpus} CPU{'' if cpus == '1' else 's'}")
    if req.get("memory_mib"):
        parts.append(format_mib(req["memory_mib"]))
    if int(req.get("gang_nodes") or 1) > 1:
        parts.append(f"on {req['gang_nodes']} nodes")
    return ", ".join(parts) or "nothing"


def request_from_options(
    gpus: str,
    gpu_mem: str | None,
    cpus: str,
    mem: str,
    exclusive: bool,
    model: list[str] | None,
    isolation: str | None,
    *,
    image: str | None = None,
    ports: list[int] | None = None,
    mig: str | None = None,
    node_selector: list[str] | None = None,
    time_limit: str | None = None,
    tolerations: list[str] | None = None,
    **extra: Any,
) -> AllocationCreate:
    """The request body from the options `cpool alloc` and `cpool run` share (client/options.py)."""
    return build_request(
        gpus=gpus, gpu_mem=gpu_mem, cpus=cpus, mem=mem, exclusive=exclusive, model=model,
        isolation=isolation, image=image, ports=ports, mig=mig, node_selector=node_selector,
        tolerations=tolerations, time_limit=time_limit, **extra,
    )  # fmt: skip


def environment(alloc: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Per node, the variables a process needs to use its slices of the allocation."""
    by_node: dict[str, list[dict[str, Any]]] = {}
    for s in alloc.get("slices") or []:
        by_node.setdefault(s["node"], []).append(s)
    env: dict[str, dict[str, str]] = {}
    for node, slices in by_node.items():
        slices.sort(key=lambda s: s["device_index"])
        devices = ",".join(s.get("device_uuid") or str(s["device_index"]) for s in slices)
        # CUDA takes uuids; other vendors' variables take the vendor's own device numbers, which
        # only the node knows: a job the agent starts gets them, a shell here gets the uuids
        nvidia = all((s.get("vendor") or "nvidia") in ("nvidia", "simulated") for s in slices)
        env[node] = {"CUDA_VISIBLE_DEVICES": devices} if nvidia else {"CPOOL_DEVICE_UUIDS": devices}
        env[node]["CPOOL_ALLOCATION_ID"] = str(alloc["id"])
    if not env:  # CPU only: still name the allocation
        for node in alloc.get("nodes") or []:
            env[str(node)] = {"CPOOL_ALLOCATION_ID": str(alloc["id"])}
    return env


def nodes_text(alloc: dict[str, Any]) -> str:
    """`a,b`; for a gang, each member's state after its node, in rank order: `a:running,b:exited 3`."""
    members = alloc.get("members") or []
    if not members:
        return ",".join(map(str, alloc.get("nodes") or []))
    parts = []
    for m in members:
        code = m.get("exit_code")
        state = m.get("state") or ""
        parts.append(f"{m['node']}:{state}" + (f" {code}" if code not in (None, 0) else ""))
    return ",".join(parts)


def show_bound(alloc: dict[str, Any]) -> None:
    what = escape(request_text(alloc.get("request") or {}))
    say(
        f"allocation [bold]{alloc['id']}[/bold] {alloc['state']}: {what}"
        f" (tenant {alloc.get('tenant')}, attempt {alloc.get('attempt', 1)})"
    )
    slices = alloc.get("slices") or []
    if slices:
        t = table(None, "node", "device", "uuid", "compute", "memory", "isolation")
        for s in slices:
            t.add_row(
                escape(s["node"]),
                str(s["device_index"]),
                escape(s.get("device_uuid") or ""),
                f"{gpus_text(int(s.get('compute_milli') or 0))} GPU",
                format_mib(int(s.get("memory_mib") or 0)),
                s.get("isolation") or "",
            )
        show(t)
    members = alloc.get("members") or []
    if members:
        g = table(None, "rank", "node", "address", "state")
        for m in members:
            g.add_row(str(m["rank"]), escape(m["node"]), escape(m.get("address") or ""), m.get("state") or "")
        show(g)
    env = environment(alloc)
    for node, variables in env.items():
        say(f"# on {escape(node)}:" if len(env) > 1 else "# use it with:")
        for k, v in variables.items():
            say(f"export {k}={escape(v)}")


def _quota_rows(quota: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(model or "", resource, {used, request, guaranteed, limit}) for each entry of explain's quota."""
    rows = [("", res, e) for res, e in quota.items() if res != "models"]
    return rows + [(m, res, e) for m, per in (quota.get("models") or {}).items() for res, e in per.items()]


def _quota_entries(quota: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for _, _, e in _quota_rows(quota)]


def quota_table(quota: dict[str, Any]) -> Any:
    """The tenant's quota as `cpool explain` shows it: one row per resource, in the units users type."""
    t = table("quota of the tenant", "resource", "in use", "this request", "guaranteed", "limit")
    for model, res, e in _quota_rows(quota):
        t.add_row(
            escape(resource_name(res, model)),
            *(format_amount(res, e.get(k)) for k in ("used", "request", "guaranteed")),
            "none" if e.get("limit") is None else format_amount(res, e["limit"]),
        )
    return t


def _explain_quietly(pool: PoolClient, alloc_id: object) -> dict[str, Any] | None:
    """The explanation only decorates the wait: a failure to get it must not end the wait."""
    try:
        return pool.explain_allocation(str(alloc_id))
    except PoolError:
        return None


def _pending_line(alloc: dict[str, Any]) -> str:
    """The reason the scheduler's last cycle stored on the allocation (no snapshot recomputed)."""
    return f"allocation {alloc['id']} pending: {alloc.get('reason') or 'waiting for the scheduler'}"


def wait_for_binding(
    pool: PoolClient, alloc: dict[str, Any], timeout: float | None, quiet: bool
) -> dict[str, Any]:
    """Poll until bound or ended, showing why it waits (a spinner on a terminal).

    On a timeout the request is withdrawn (cancelled) so nothing keeps waiting unseen.
    """
    from computepool.cli.logstream import follower

    alloc_id = alloc["id"]
    rider = follower(f"allocation {alloc_id}")  # answers on binding; a control plane away is waited for
    deadline = None if timeout is None else time.monotonic() + timeout
    spinner: AbstractContextManager[Any] = nullcontext()
    live = not quiet and err_console.is_terminal
    if live:
        spinner = err_console.status(Text(_pending_line(alloc)))
    last_line = ""
    with spinner as status:
        while alloc.get("state") == PENDING:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                explain = _explain_quietly(pool, alloc_id) or {}
                pool.cancel_allocation(alloc_id)
                raise fail(
                    f"allocation {alloc_id} not bound within {timeout:g} s, cancelled: "
                    f"{explain.get('summary') or 'no reason given'}",
                    code=1,
                )
            line = _pending_line(alloc)
            if live:
                status.update(Text(line))  # the server's words as is, not markup
            elif not quiet and line != last_line:
                err_console.print(line, highlight=False, markup=False, soft_wrap=True)
            last_line = line
            pause = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            alloc = rider.call(partial(pool.get_allocation, alloc_id, wait=pause, state=PENDING))
    return alloc


def register(app: typer.Typer) -> None:
    @app.command("alloc")
    @pool_command
    def alloc(
        gpus: GpusOpt = "0",
        gpu_mem: GpuMemOpt = None,
        cpus: CpusOpt = "0",
        mem: MemOpt = "0",
        exclusive: ExclusiveOpt = False,
        model: ModelOpt = None,
        vendor: VendorOpt = None,
        min_gpu_mem: MinGpuMemOpt = None,
        accelerator: AcceleratorOpt = None,
        stack: StackOpt = None,
        job_type: JobTypeOpt = None,
        isolation: IsolationOpt = None,
        image: ImageOpt = None,
        port: PortOpt = None,
        mig: MigOpt = None,
        node_selector: SelectorOpt = None,
        toleration: TolerationOpt = None,
        time_limit: TimeLimitOpt = None,
        nodes: NodesOpt = 1,
        colocate: ColocateOpt = None,
        priority: PriorityOpt = 0,
        name: NameOpt = None,
        tenant: TenantOpt = None,
        no_wait: Annotated[bool, typer.Option("--no-wait", help="Submit and return at once.")] = False,
        timeout: Annotated[
            float | None, typer.Option("--timeout", min=0, help="Give up (and cancel) after S seconds.")
        ] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Ask the pool for GPUs (whole or a slice), CPUs and memory; wait until bound; say how to use it."""
        req = request_from_options(
            gpus, gpu_mem, cpus, mem, exclusive, model, isolation,
            image=image, ports=port, mig=mig, node_selector=node_selector, time_limit=time_limit,
            tolerations=toleration, nodes=nodes, priority=priority, name=name, tenant=tenant,
            colocate=colocate, vendor=vendor, min_gpu_mem=min_gpu_mem, accelerator=accelerator, stack=stack,
            job_type=job_type,
        )  # fmt: skip
        with open_client(server, token) as pool:
            out = pool.create_allocation(req)
            if not no_wait:
                try:
                    out = wait_for_binding(pool, out, timeout, quiet=json_out)
                except KeyboardInterrupt:  # as `cpool run`: no one waits for it, so withdraw it
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                    with suppress(PoolError, ServerUnreachable):
                        pool.cancel_allocation(str(out["id"]))
                    raise fail(f"cancelled allocation {out['id']}", code=130) from None
        if json_out:
            print_json({**out, "environment": environment(out)})
        elif out["state"] == PENDING:
            say(f"allocation {out['id']} submitted (pending); `cpool explain {out['id']}` says why")
        elif out["state"] not in ENDED_STATES:
            show_bound(out)
        if out["state"] in ENDED_STATES:
            raise fail(
                f"allocation {out['id']} {out['state']}: {out.get('reason') or 'no reason given'}", code=1
            )

    def ender(verb: str, doc: str) -> None:
        @app.command(verb, help=doc)
        @pool_command
        def end(
            alloc_id: Annotated[
                str,
                typer.Argument(
                    metavar="ID", help="Allocation id; a job array's id: all its jobs (ID_INDEX: one)."
                ),
            ],
            server: ServerOpt = None,
            token: TokenOpt = None,
            json_out: JsonOpt = False,
        ) -> None:
            from computepool.cli.array_run import resolve

            with open_client(server, token) as pool:
                ids, whole = resolve(pool, alloc_id)
                states = HOLDING if verb == "release" else LIVE
                outs = [
                    getattr(pool, f"{verb}_allocation")(i)
                    for i in ids
                    if not whole or pool.get_allocation(i)["state"] in states
                ]
            if json_out:
                print_json(outs if whole else outs[0])
            elif whole:
                done = "cancelled" if verb == "cancel" else "released"
                say(f"array {alloc_id}: {done} {len(outs)} of {len(ids)} jobs")
            else:
                say(f"allocation {outs[0]['id']}: {outs[0]['state']}")

    ender(
        "release",
        "Give a bound or running allocation's devices back (state released). A running job is stopped "
        "by its agent: SIGTERM, then SIGKILL after the agent's --kill-grace-s.",
    )
    ender(
        "cancel",
        "Withdraw an allocation in any live state — pending, bound or running (state cancelled). A "
        "running job is stopped as by release; a cancelled allocation is never requeued, restartable "
        "or not.",
    )

    @app.command("ps")
    @pool_command
    def ps(
        all_: Annotated[bool, typer.Option("--all", "-a", help="Ended allocations too.")] = False,
        tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant (admins).")] = None,
        limit: Annotated[int, typer.Option("--limit", min=1, max=10_000)] = 200,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Allocations you may see: pending, bound and active ones (all with --all)."""
        with open_client(server, token) as pool:
            if all_:
                items = pool.list_allocations(tenant=tenant, limit=limit)
            else:
                items = [a for s in LIVE for a in pool.list_allocations(s, tenant, limit)]
        items.sort(key=lambda a: str(a.get("created_at") or ""))
        if json_out:
            print_json(items)
            return
        if not items:
            say("no allocations" + ("" if all_ else " held or queued (--all for ended ones)"))
            return
        t = table(None, "id", "name", "tenant", "owner", "state", "request", "nodes", "created", "reason")
        for a in items:
            t.add_row(
                str(a["id"]) + (f" [{a['array_index']}]" if a.get("array_index") is not None else ""),
                escape(a.get("name") or ""),
                a.get("tenant") or "",
                a.get("owner") or "",
                state_text(a),
                escape(request_text(a.get("request") or {})),
                escape(nodes_text(a)),
                short_time(a.get("created_at")),
                escape(a.get("reason") or ""),
            )
        show(t)

    @app.command("explain")
    @pool_command
    def explain(
        alloc_id: Annotated[str, typer.Argument(metavar="ID", help="Allocation id.")],
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Why an allocation is where it is: for a pending one, what each node lacks."""
        with open_client(server, token) as pool:
            out = pool.explain_allocation(alloc_id)
        if json_out:
            print_json(out)
            return
        pos = out.get("queue_position")
        say(
            f"allocation {alloc_id}: [bold]{out.get('state')}[/bold]"
            + (f", queue position {pos}" if pos is not None else ""),
        )
        if out.get("summary"):
            say(escape(str(out["summary"])))
        reasons = out.get("reasons") or {}
        counts = reasons.get("counts") or {}
        if counts:
            t = table(None, "nodes", "reason")
            for reason, n in sorted(counts.items(), key=lambda kv: -int(kv[1])):
                t.add_row(str(n), escape(str(reason)))
            show(t)
        for note in reasons.get("notes") or []:
            say(f"- {escape(str(note))}")
        quota = out.get("quota") or {}
        if any(e.get("limit") is not None or e.get("guaranteed") is not None for e in _quota_entries(quota)):
            show(quota_table(quota))
        elif quota:
            say("quota: none for this tenant (nothing guaranteed, no limit but the pool)")

    @app.command("logs")
    @pool_command
    def logs(
        alloc_id: Annotated[str, typer.Argument(metavar="ID", help="Allocation id.")],
        follow: Annotated[
            bool,
            typer.Option(
                "--follow",
                "-f",
                help="Keep printing until the job ends, then say how it ended (on stderr) and exit "
                "with its exit code, as `cpool run` does.",
            ),
        ] = False,
        rank: Annotated[
            int | None,
            typer.Option(
                "--rank",
                min=0,
                help="One member of a gang (0 = the first node); default: all, lines prefixed [rank N].",
            ),
        ] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Print the output of an allocation's command: its stdout on stdout, its stderr on stderr."""
        from computepool.cli.logstream import copy_output, ended_line, exit_code, follower

        def whose(out: dict[str, Any]) -> None:
            ranks = int(out.get("ranks") or 1)
            if ranks > 1:
                err_console.print(
                    f"(output of every rank of {ranks}, each line prefixed [rank N]; --rank R shows one)"
                    if rank is None
                    else f"(output of rank {out.get('rank', 0)} of {ranks})",
                    highlight=False,
                    markup=False,
                    style="dim",
                )

        from computepool.cli.array_run import array_exit, copy_members, resolve

        with open_client(server, token, timeout=60.0) as pool:
            # following: a control plane away at the first call is waited for, as later ones are
            ask = follower(f"job {alloc_id}").call if follow else (lambda f: f())
            ids, whole = ask(lambda: resolve(pool, alloc_id))
            if whole:
                outs = copy_members(pool, int(alloc_id), follow=follow)
                if follow:
                    raise typer.Exit(array_exit(int(alloc_id), outs, ids))
                return
            alloc_id = ids[0]
            out = copy_output(pool, alloc_id, rank=rank, follow=follow, first=whose)
        if follow:
            err_console.print(ended_line(alloc_id, out), highlight=False, markup=False, soft_wrap=True)
            raise typer.Exit(exit_code(out))
