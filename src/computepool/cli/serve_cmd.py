"""`cpool serve` and `cpool services`: model services, elastic replicas behind the pool's gateway.

`cpool serve NAME --command '…'` creates the service or, given again, changes it (the whole spec
each time, as a PUT: its replicas are then replaced one by one); `--delete` drains and removes it.
`cpool services` lists them, `services show` lists one's replicas, `services usage` sums what
the gateway recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from computepool.cli.alloc_cmd import (
    CpusOpt,
    ExclusiveOpt,
    GpuMemOpt,
    GpusOpt,
    ImageOpt,
    IsolationOpt,
    MemOpt,
    MigOpt,
    ModelOpt,
    SelectorOpt,
    TolerationOpt,
    request_text,
)
from computepool.cli.common import print_json
from computepool.cli.pool_cmd import (
    JsonOpt,
    ServerOpt,
    TokenOpt,
    open_client,
    parse_time,
    pool_command,
    say,
    short_time,
    show,
    table,
)
from computepool.cli.secrets_cmd import SecretOpt
from computepool.cli.ship_opts import EnvFileOpt, EnvOpt, NoCodeOpt, WorkdirOpt
from computepool.client import PoolClient, PoolError
from computepool.client.http import ENDED_STATES
from computepool.core.errors import InvalidInput
from computepool.core.servers import ServerArg

USAGE_BY = {
    "tenant": ("tenant",),
    "user": ("user",),
    "token": ("token_id",),
    "service": ("tenant", "service"),
}
USAGE_SUMS = ("requests", "failed", "prompt_tokens", "completion_tokens")

TenantOpt = Annotated[
    str | None, typer.Option("--tenant", help="Admins: the service of this tenant.", show_default=False)
]


def _current(pool: PoolClient, name: str, tenant: str | None) -> dict[str, Any] | None:
    """The service as it stands, or None when there is none by that name."""
    try:
        return pool.service(name, tenant)
    except PoolError as e:
        if e.status == 404:
            return None
        raise


def _changed_line(before: dict[str, Any] | None, out: dict[str, Any]) -> str:
    name, generation, spec = out["name"], out["generation"], out.get("spec") or {}
    if before is None:
        return (
            f"service {name} created (generation {generation}): min {spec.get('min_replicas')}, "
            f"max {spec.get('max_replicas')}, target {spec.get('target_inflight')} in flight per replica"
        )
    if generation != before.get("generation"):
        return f"service {name} updated to generation {generation}: replicas are replaced one by one"
    return f"service {name} unchanged (generation {generation})"


def _live_replicas(out: dict[str, Any]) -> int:
    return sum(1 for r in out.get("replicas") or [] if r.get("state") not in ENDED_STATES)


def _typed(ctx: typer.Context, param: str) -> bool:
    """Whether the option was given (on the command line or by its variable), not left at its default."""
    source = ctx.get_parameter_source(param)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def register(app: typer.Typer) -> None:
    @app.command("serve", context_settings={"allow_extra_args": True})
    @pool_command
    def serve(
        ctx: typer.Context,
        name: Annotated[
            str | None,
            typer.Argument(
                metavar="NAME",
                help="The service: the `model` clients name at the gateway.",
                show_default=False,
            ),
        ] = None,
        command: Annotated[
            str | None,
            typer.Option(
                "--command",
                help="The engine's command line, run by /bin/sh (so $PORT works); "
                "or its words after `--` (no shell).",
                show_default=False,
            ),
        ] = None,
        port_env: Annotated[
            str, typer.Option("--port-env", help="The variable that tells each replica its port.")
        ] = "PORT",
        gpus: GpusOpt = "0",
        gpu_mem: GpuMemOpt = None,
        cpus: CpusOpt = "0",
        mem: MemOpt = "0",
        exclusive: ExclusiveOpt = False,
        model: ModelOpt = None,
        isolation: IsolationOpt = None,
        image: ImageOpt = None,
        mig: MigOpt = None,
        node_selector: SelectorOpt = None,
        toleration: TolerationOpt = None,
        priority: Annotated[int, typer.Option("--priority", help="Replicas' priority in the tenant.")] = 0,
        env: EnvOpt = None,
        env_file: EnvFileOpt = None,
        secret: SecretOpt = None,
        workdir: WorkdirOpt = None,
        no_code: NoCodeOpt = False,
        min_: Annotated[
            int | None, typer.Option("--min", min=0, help="Fewest replicas (0: scale to zero when idle).")
        ] = None,
        max_: Annotated[int | None, typer.Option("--max", min=1, help="Most replicas.")] = None,
        target_inflight: Annotated[
            int | None,
            typer.Option("--target-inflight", min=1, help="Requests in flight per replica to scale for."),
        ] = None,
        max_inflight: Annotated[
            int | None,
            typer.Option(
                "--max-inflight", min=1, help="Requests one replica gets at once (default 2 × target)."
            ),
        ] = None,
        health_path: Annotated[
            str | None,
            typer.Option("--health-path", help="Answers 2xx once a replica is ready (default /health)."),
        ] = None,
        startup_grace: Annotated[
            str | None, typer.Option("--startup-grace", help="Time a replica has to become healthy, e.g. 5m.")
        ] = None,
        idle: Annotated[
            str | None, typer.Option("--idle", help="With --min 0: no request this long scales to zero.")
        ] = None,
        scale_down_delay: Annotated[
            str | None,
            typer.Option("--scale-down-delay", help="Low load this long before a replica is removed."),
        ] = None,
        drain: Annotated[
            str | None, typer.Option("--drain", help="Time a removed replica has to finish its requests.")
        ] = None,
        queue_timeout: Annotated[
            str | None, typer.Option("--queue-timeout", help="A request waiting longer is answered 503.")
        ] = None,
        file: Annotated[
            Path | None,
            typer.Option("--file", "-f", help="A YAML spec: the option names as keys; flags given here win."),
        ] = None,
        delete: Annotated[
            bool, typer.Option("--delete", help="Remove the service: its replicas drain, then end.")
        ] = False,
        cooperative: Annotated[
            bool,
            typer.Option(
                "--cooperative",
                help="Split one GGUF model (--model FILE.gguf, its path on the nodes) over devices of "
                "several nodes (llama.cpp RPC); the pool writes the engine's command.",
            ),
        ] = False,
        engine_python: Annotated[
            str | None,
            typer.Option(
                "--engine-python", help="With --cooperative: Python with llama-cpp-python (RPC) on the nodes."
            ),
        ] = None,
        ctx_len: Annotated[
            int | None, typer.Option("--ctx", min=16, help="With --cooperative: context length.")
        ] = None,
        max_nodes: Annotated[
            int | None,
            typer.Option("--max-nodes", min=1, help="With --cooperative: at most this many nodes."),
        ] = None,
        min_gain: Annotated[
            str | None,
            typer.Option(
                "--min-gain", help="With --cooperative: split only when predicted this much faster (1.1)."
            ),
        ] = None,
        force_split: Annotated[
            int | None,
            typer.Option(
                "--force-split",
                min=1,
                help="With --cooperative: exactly this many nodes (1: the fastest device).",
            ),
        ] = None,
        tenant: TenantOpt = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Serve a model: `cpool serve NAME --command 'ENGINE --port $PORT' --gpus 0.25 --max 4`.

        Replicas scale with the requests at the gateway (SERVER/v1, OpenAI-compatible, pool tokens).
        Given again, the whole spec is replaced and the replicas are renewed one by one.
        """
        from computepool.cli import serve_spec, ship

        if delete:
            if ctx.args or any(_typed(ctx, k) for k in ("command", "file")):
                raise InvalidInput("--delete", "takes only the service's name (and --tenant)")
            if not name:
                raise InvalidInput("NAME", "name the service to delete")
            with open_client(server, token) as pool:
                out = pool.delete_service(name, tenant)
            if json_out:
                print_json(out)
            else:
                n = _live_replicas(out)
                say(f"service {out['name']} deleted: {n} replica{'' if n == 1 else 's'} draining")
            return
        given: dict[str, Any] = {}
        for key, param in serve_spec.FILE_KEYS.items():
            if param in ctx.params and _typed(ctx, param):
                given[key] = ctx.params[param]
        defaults = {key: ctx.params.get(param) for key, param in serve_spec.FILE_KEYS.items()}
        spec_file = serve_spec.load_spec_file(file) if file is not None else None
        src = serve_spec.Sources(given, defaults, spec_file)
        draft = serve_spec.draft_service(name, src, list(ctx.args))
        with open_client(server, token, timeout=60.0) as pool:
            before = _current(pool, draft.name, draft.tenant)
            if "cooperative" in draft.fields:  # no code to ship: the engine is the pool's
                req = draft.request
            else:
                req = ship.ship(
                    pool, draft.request, workdir=draft.workdir, no_code=draft.no_code, env=draft.env or None,
                    stdin=None, env_file=draft.env_file,
                )  # fmt: skip
            out = pool.put_service(draft.name, draft.spec(req), draft.tenant)
        if json_out:
            print_json(out)
        else:
            say(_changed_line(before, out))

    services = typer.Typer(help="Model services: list (the default), show one's replicas, gateway usage.")
    app.add_typer(services, name="services")

    def list_services(server: ServerArg, token: str | None, json_out: bool) -> None:
        with open_client(server, token) as pool:
            items = pool.services()
        if json_out:
            print_json(items)
            return
        if not items:
            say("no services (`cpool serve NAME --command '…'` starts one)")
            return
        t = table(None, "name", "tenant", "ready/desired", "in flight", "queued", "generation", "reason")
        for s in sorted(items, key=lambda s: (str(s.get("tenant")), str(s.get("name")))):
            t.add_row(
                escape(str(s["name"])),
                escape(str(s.get("tenant") or "")),
                f"{s.get('ready', 0)}/{s.get('desired', 0)}",
                str(s.get("inflight", 0)),
                str(s.get("queued", 0)),
                str(s.get("generation", "")),
                escape(str(s.get("reason") or "")),
            )
        show(t)

    @services.callback(invoke_without_command=True)
    @pool_command
    def default(
        ctx: typer.Context, server: ServerOpt = None, token: TokenOpt = None, json_out: JsonOpt = False
    ) -> None:
        """Without a subcommand: the same as `cpool services list`."""
        if ctx.invoked_subcommand is None:
            list_services(server, token, json_out)

    @services.command("list")
    @pool_command
    def list_(server: ServerOpt = None, token: TokenOpt = None, json_out: JsonOpt = False) -> None:
        """Your tenant's services (admins: all): replicas ready of desired, load, and why."""
        list_services(server, token, json_out)

    @services.command("show")
    @pool_command
    def show_(
        name: Annotated[str, typer.Argument(help="The service.")],
        tenant: TenantOpt = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """One service: its spec in brief and each replica (state, node, endpoint, requests in flight)."""
        with open_client(server, token) as pool:
            out = pool.service(name, tenant)
            base = pool.server
        if json_out:
            print_json(out)
            return
        show_service(out, base)

    @services.command("explain")
    @pool_command
    def explain(
        name: Annotated[str, typer.Argument(help="The cooperative service.")],
        tenant: TenantOpt = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """A cooperative service's plan: its shards, measured speeds, links, the options weighed, and why."""
        with open_client(server, token) as pool:
            out = pool.service_plan(name, tenant)
        if json_out:
            print_json(out)
            return
        show_plan(out)

    @services.command("usage")
    @pool_command
    def usage(
        since: Annotated[
            str, typer.Option("--since", help="From this time (ISO 8601) or this long ago (7d, 12h).")
        ] = "7d",
        by: Annotated[str, typer.Option("--by", help="Sum by tenant, user, token or service.")] = "service",
        tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant (admins).")] = None,
        service: Annotated[str | None, typer.Option("--service", help="Only this service.")] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Gateway requests, failures and tokens, summed by tenant, user, token or service."""
        if by not in USAGE_BY:
            raise InvalidInput("--by", f"unknown {by!r} (choose from {', '.join(USAGE_BY)})")
        when = parse_time(since, "--since")
        with open_client(server, token) as pool:
            rows = pool.gateway_usage(when, tenant, service)
        sums = sum_usage(rows, USAGE_BY[by])
        if json_out:
            print_json(sums)
            return
        if not sums:
            say(f"no gateway requests since {short_time(when)}")
            return
        keys = USAGE_BY[by]
        t = table(None, *("token" if k == "token_id" else k for k in keys), *USAGE_SUMS)
        for row in sums:
            t.add_row(*(escape(str(row[k])) for k in keys), *(str(row[k]) for k in USAGE_SUMS))
        show(t)


def sum_usage(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """UsageRows (one per tenant, user, token, service and hour) summed per value of `keys`;
    the busiest first."""
    out: dict[tuple[str, ...], dict[str, Any]] = {}
    for r in rows:
        k = tuple(str(r.get(key) or "") for key in keys)
        acc = out.setdefault(k, {**dict(zip(keys, k, strict=True)), **dict.fromkeys(USAGE_SUMS, 0)})
        for f in USAGE_SUMS:
            acc[f] += int(r.get(f) or 0)
    return sorted(out.values(), key=lambda a: (-a["requests"], *(a[k] for k in keys)))


def show_service(out: dict[str, Any], base: str) -> None:
    spec = out.get("spec") or {}
    req = spec.get("request") or {}
    say(
        f"service [bold]{escape(str(out['name']))}[/bold] (tenant {escape(str(out.get('tenant')))}, "
        f"generation {out.get('generation')}): {out.get('ready', 0)} ready of {out.get('desired', 0)} "
        f"desired; {out.get('inflight', 0)} in flight, {out.get('queued', 0)} queued"
    )
    command = " ".join(req.get("command") or [])
    say(
        f"replicas: {escape(request_text(req))} each, {spec.get('min_replicas')}–{spec.get('max_replicas')}, "
        f"target {spec.get('target_inflight')} in flight; command: {escape(command)}"
    )
    say(f"gateway: {escape(base)}/v1 with model {escape(str(out['name']))}")
    if out.get("reason"):
        say(f"reason: {escape(str(out['reason']))}")
    replicas = out.get("replicas") or []
    if not replicas:
        say("no replicas")
        return
    t = table(None, "id", "state", "replica state", "node", "endpoint", "in flight", "generation", "reason")
    for r in replicas:
        t.add_row(
            str(r["allocation_id"]),
            str(r.get("state") or ""),
            str(r.get("replica_state") or "-"),
            escape(str(r.get("node") or "-")),
            escape(str(r.get("endpoint") or "-")),
            str(r.get("inflight", 0)),
            str(r.get("generation", "")),
            escape(str(r.get("reason") or "")),
        )
    show(t)


def _tps(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, int | float) else "-"


def _shards_table(title: str | None, shards: list[dict[str, Any]]) -> None:
    t = table(title, "node", "device", "role", "layers", "memory MiB", "tokens/s alone", "endpoint")
    for s in shards:
        first, n = int(s.get("first_layer") or 0), int(s.get("layers") or 0)
        t.add_row(
            escape(str(s["node"])), escape(str(s["device"])), str(s["role"]),
            f"{first}-{first + n - 1}" if n else "-", str(s.get("memory_mib", "")),
            _tps(s.get("tokens_per_s")), escape(str(s.get("endpoint") or "-")),
        )  # fmt: skip
    show(t)


def show_plan(out: dict[str, Any]) -> None:
    """`cpool services explain`: the chosen split, predicted vs measured, and what was weighed."""
    say(
        f"service [bold]{escape(str(out['service']))}[/bold]: {out['status']} "
        f"(plan {out.get('attempt', 0)}); "
        f"predicted {_tps(out.get('predicted_tokens_per_s'))} tokens/s, "
        f"measured {_tps(out.get('measured_tokens_per_s'))}"
    )
    say(f"reason: {escape(str(out.get('reason') or ''))}")
    if out.get("shards"):
        _shards_table("chosen", out["shards"])
    best = out.get("best_single")
    if best:
        say(f"best single device: {escape(str(best['node']))} {escape(str(best['device']))}, "
            f"{_tps(best.get('tokens_per_s'))} tokens/s")  # fmt: skip
    cands = out.get("candidates") or []
    if cands:
        t = table("candidates", "node", "device", "tokens/s", "memory MiB", "holds model", "note")
        for c in cands:
            t.add_row(
                escape(str(c["node"])), escape(str(c["device"])), _tps(c.get("tokens_per_s")),
                str(c.get("memory_mib", "")), "yes" if c.get("holds_model") else "no",
                escape(str(c.get("note") or "")),
            )  # fmt: skip
        show(t)
    links = out.get("links") or []
    if links:
        t = table("links", "from", "to", "rtt ms", "bandwidth Mbit/s")
        for k in links:
            t.add_row(
                escape(str(k["a"])), escape(str(k["b"])), _tps(k.get("rtt_ms")), _tps(k.get("bandwidth_mbps"))
            )
        show(t)
    for i, o in enumerate(out.get("options") or [], 1):
        nodes = ", ".join(f"{s['node']}:{s['device']}×{s['layers']}" for s in o.get("shards") or [])
        say(f"option {i}: {escape(nodes)}: {_tps(o.get('predicted_tokens_per_s'))} tokens/s predicted"
            + (f" ({escape(str(o['note']))})" if o.get("note") else ""))  # fmt: skip
