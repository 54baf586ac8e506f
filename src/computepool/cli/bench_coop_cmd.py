"""`cpool bench coop`: cooperative inference on a pool of its own (tiny model, agents, one impostor)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from computepool.cli.common import err_console, fail
from computepool.cli.pool_cmd import pool_command
from computepool.core.errors import InvalidInput


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("coop")
    @pool_command
    def coop(
        tokens: Annotated[int, typer.Option("--tokens", help="Completion tokens per timed request.")] = 32,
        runs: Annotated[
            int, typer.Option("--runs", help="Timed requests per service (after a warm-up).")
        ] = 3,
        engine_python: Annotated[
            str | None,
            typer.Option(
                "--engine-python",
                help="Python with llama-cpp-python built with GGML_RPC=ON (default: $CPOOL_LLAMA_PYTHON, "
                "else the venv of scripts/llama-venv.sh).",
            ),
        ] = None,
        json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """Split the tiny test model over two nodes and compare it with one, on a pool of its own: a
        server and two root agents on loopback that find each other by discovery, plus one impostor
        announcing itself with a wrong key (it must be rejected).

        The model is served cooperatively three times, one after the other: on the fastest single
        device, forced over two nodes, and where the pool chooses. Reports peers_found,
        peers_rejected, split_equals_single (greedy texts equal), single_/split_/chosen_tokens_per_s
        (completion tokens over request time through the gateway, median of --runs) and chosen (the
        shards the pool picked). Needs root (tenant users) and a llama.cpp venv."""
        from computepool.cli.bench_pool_cmd import _show
        from computepool.client.bench_coop import (
            BenchError,
            CoopBenchSettings,
            default_engine_python,
            run_coop_bench,
        )

        try:
            settings = CoopBenchSettings(
                engine_python=engine_python or default_engine_python(), tokens=tokens, runs=runs
            )
        except ValueError as e:
            field, _, why = str(e).partition(": ")
            raise InvalidInput(f"--{field.replace('_', '-')}", why or str(e)) from None

        def say(line: str) -> None:
            if not json_out:
                err_console.print(line, highlight=False, markup=False)

        try:
            from computepool.agent.tenants import remove_tenant_user

            out: dict[str, Any] = run_coop_bench(settings, say, remove_tenant_user)
        except BenchError as e:
            raise fail(f"bench coop: {e}", 1) from None
        if json_out:
            _show("", out, True)
            return
        chosen = ", ".join(
            f"{sh['node']}/{sh['device']} layers {sh['first_layer']}+{sh['layers']}" for sh in out["chosen"]
        )
        figures = {
            k: out[k]
            for k in ("peers_found", "peers_rejected", "split_equals_single", "single_tokens_per_s",
                      "split_tokens_per_s", "chosen_tokens_per_s")
        }  # fmt: skip
        _show(
            "Cooperative inference benchmark",
            {**figures, "chosen": chosen, "why": out["chosen_reason"]},
            False,
        )
