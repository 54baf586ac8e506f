"""The `cpool` command: one Typer app; each command group lives in its own module.

Start-up time is every command's latency: this module and the command modules import only what
registering their options needs (typer, rich, the HTTP client); servers, databases, numpy and
the simulator load inside the commands that use them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="ComputePool: one pool of GPUs and CPUs.")
sim_app = typer.Typer(no_args_is_help=True, help="Replay real cluster traces through the scheduler.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print JSON figures.")
app.add_typer(sim_app, name="sim")
app.add_typer(bench_app, name="bench")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"cpool {version('computepool')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            typer.echo("cpool (version unknown: not installed)")
        raise typer.Exit()


@app.callback()
def _root(
    _version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
    ca: Annotated[
        Path | None,
        typer.Option(
            "--ca",
            envvar="CPOOL_CA",
            help="PEM file an https server's certificate must chain to (else what `cpool login` saved).",
        ),
    ] = None,
    outage_wait: Annotated[
        str | None,
        typer.Option(
            "--outage-wait",
            envvar="CPOOL_OUTAGE_WAIT",
            help="How long `run`, `logs -f` and `alloc` wait for a control plane that is away (a "
            "restart, a failover) before giving up: e.g. 30m, 2h; 0 not at all. Default 15m.",
        ),
    ] = None,
) -> None:
    """ComputePool: one pool of GPUs and CPUs."""
    if ca is not None:
        os.environ["CPOOL_CA"] = str(ca.expanduser().absolute())  # read by every client this run makes
    if outage_wait is not None:
        from computepool.client.follow import OUTAGE_ENV, outage_wait_s
        from computepool.core.errors import InvalidInput

        try:
            outage_wait_s(outage_wait, "--outage-wait")
        except InvalidInput as e:
            from computepool.cli.common import fail

            raise fail(str(e)) from None
        os.environ[OUTAGE_ENV] = outage_wait  # read by every follower this run makes


def _register() -> None:
    from computepool.cli import (
        access_cmd,
        agent_cmd,
        alerts_cmd,
        alloc_cmd,
        audit_cmd,
        bench_api_cmd,
        bench_chaos_cmd,
        bench_cmd,
        bench_cycle_cmd,
        bench_pool_cmd,
        cp_cmd,
        exec_cmd,
        forward_cmd,
        gateway_cmd,
        images_cmd,
        nodes_cmd,
        peers_cmd,
        quota_cmd,
        run_cmd,
        secrets_cmd,
        serve_cmd,
        server_cmd,
        sim_fill,
        sim_gangs,
        sim_hetero,
        sim_replay,
        sim_report,
        tenants_cmd,
        throughputs_cmd,
        up_cmd,
        usage_cmd,
    )

    sim_fill.register(sim_app)
    sim_replay.register(sim_app)
    sim_report.register(sim_app)
    sim_gangs.register(sim_app)
    sim_hetero.register(sim_app)
    bench_cmd.register(bench_app)
    server_cmd.register(app)
    gateway_cmd.register(app)
    agent_cmd.register(app)
    up_cmd.register(app)
    access_cmd.register_login(app)  # the order of `cpool --help`
    tenants_cmd.register(app)
    images_cmd.register(app)
    secrets_cmd.register(app)
    access_cmd.register_tokens(app)
    quota_cmd.register(app)
    access_cmd.register_join_token(app)
    audit_cmd.register(app)
    nodes_cmd.register(app)
    peers_cmd.register(app)
    alloc_cmd.register(app)
    run_cmd.register(app)
    serve_cmd.register(app)
    usage_cmd.register(app)
    throughputs_cmd.register(app)
    alerts_cmd.register(app)
    cp_cmd.register(app)
    exec_cmd.register(app)
    forward_cmd.register(app)
    bench_api_cmd.register(bench_app)
    bench_cycle_cmd.register(bench_app)
    bench_pool_cmd.register(bench_app)
    bench_chaos_cmd.register(bench_app)


# Each top-level command word: the module that defines it and the function that registers it.
# `cpool WORD …` loads and builds only that module (its help, options and exit codes are the same as
# in the full app); none, an unknown word, `sim` or `bench` load every command as `cpool --help`
# lists them.
_QUICK: dict[str, tuple[str, str]] = {
    **dict.fromkeys(("alloc", "release", "cancel", "ps", "explain", "logs"), ("alloc_cmd", "register")),
    **dict.fromkeys(("run", "top"), ("run_cmd", "register")),
    **dict.fromkeys(("login", "logout"), ("access_cmd", "register_login")),
    "tokens": ("access_cmd", "register_tokens"),
    "join-token": ("access_cmd", "register_join_token"),
    **dict.fromkeys(("tenants", "users"), ("tenants_cmd", "register")),
    **dict.fromkeys(("serve", "services"), ("serve_cmd", "register")),
    **dict.fromkeys(("usage", "prices"), ("usage_cmd", "register")),
    **{
        word: (f"{word}_cmd", "register")
        for word in ("server", "gateway", "agent", "up", "images", "quota", "audit", "nodes", "peers")
    },
    "alerts": ("alerts_cmd", "register"),
    "cp": ("cp_cmd", "register"),
    "exec": ("exec_cmd", "register"),
    "forward": ("forward_cmd", "register"),
    "secrets": ("secrets_cmd", "register"),
    "throughputs": ("throughputs_cmd", "register"),
}

# Optional imports of libraries the client loads that no `cpool` command uses: httpcore imports trio
# (when installed) only to tell whether async code runs under it, and httpx imports its own
# command-line tool (click, pygments, rich.syntax). Together about half of `cpool ps`'s start-up.
_UNUSED_OPTIONAL = ("trio", "httpx._main")


def _command_word(argv: list[str]) -> str | None:
    """The command named on the line: the first word neither an option nor a global option's value."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--ca", "--outage-wait"):
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


# One-shot client commands: once they are done nothing is left to tidy but the interpreter's own
# teardown of every module they loaded (~70 ms of a tiny job's `cpool run`), which `_leave` skips.
_PROMPT_EXIT = frozenset(("ps", "run", "logs", "explain", "cancel", "release"))


def _leave(code: object) -> None:
    """Exit at once with `code` (SystemExit's meaning): exit handlers run and output is flushed, but
    modules are not torn down. Where another thread still runs, the usual exit waits for it."""
    import atexit
    import os
    import sys
    import threading

    if threading.active_count() > 1:
        raise SystemExit(code)
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: the output is gone either way
            status = status or 1
    os._exit(status)


def main() -> None:
    import importlib
    import sys

    for name in _UNUSED_OPTIONAL:  # None in sys.modules: `import name` raises ImportError, as if absent
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    word = _command_word(sys.argv[1:]) or ""
    quick = _QUICK.get(word)
    if quick is not None:
        module, register = quick
        getattr(importlib.import_module(f"computepool.cli.{module}"), register)(app)
    else:
        _register()
    if word not in _PROMPT_EXIT:
        app()
        return
    try:
        app()
    except SystemExit as e:
        _leave(e.code)
    _leave(0)


if __name__ == "__main__":
    main()
