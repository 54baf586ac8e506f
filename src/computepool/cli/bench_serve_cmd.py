"""`cpool bench serve`: a model service static on dedicated devices vs elastic on a shared pool."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from computepool.cli.common import err_console, fail
from computepool.cli.pool_cmd import pool_command
from computepool.core.errors import InvalidInput


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("serve")
    @pool_command
    def serve(
        seed: Annotated[int, typer.Option("--seed", help="Seed of the trace's arrivals.")] = 7,
        day_s: Annotated[
            float,
            typer.Option("--day-s", min=10, max=86_400, help="Seconds the 24-hour day is compressed into."),
        ] = 120.0,
        peak_rps: Annotated[
            float, typer.Option("--peak-rps", min=0.1, max=1000, help="Requests per second at the peak.")
        ] = 6.0,
        gpus: Annotated[int, typer.Option("--gpus", min=1, max=64, help="Simulated GPUs in the pool.")] = 4,
        nodes: Annotated[
            int, typer.Option("--nodes", min=1, max=16, help="Agents the GPUs are split over.")
        ] = 2,
        replicas: Annotated[
            int | None,
            typer.Option(
                "--replicas", min=1, max=64, help="Replicas the peak needs (default: sized from the trace)."
            ),
        ] = None,
        slots: Annotated[
            int, typer.Option("--slots", min=1, max=256, help="Requests one engine works on at once.")
        ] = 2,
        ms_per_token: Annotated[
            float, typer.Option("--ms-per-token", min=0.1, max=10_000, help="Engine time per token.")
        ] = 50.0,
        max_tokens: Annotated[
            int, typer.Option("--max-tokens", min=1, max=4096, help="Completion tokens per request.")
        ] = 16,
        target_inflight: Annotated[
            int,
            typer.Option(
                "--target-inflight", min=1, max=10_000, help="Pooled: requests per replica aimed at."
            ),
        ] = 2,
        min_replicas: Annotated[
            int, typer.Option("--min-replicas", min=0, max=64, help="Pooled: replicas kept in the trough.")
        ] = 1,
        scale_down_delay: Annotated[
            int,
            typer.Option(
                "--scale-down-delay",
                min=0,
                max=86_400,
                help="Pooled: seconds of lower load before a removal.",
            ),
        ] = 5,
        batch_job_hours: Annotated[
            float,
            typer.Option("--batch-job-hours", min=0.01, max=24, help="One batch job's length, trace hours."),
        ] = 1.0,
        json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """Replay a day-shaped request trace against one service twice, on a pool of its own (a server
        and --nodes agents with simulated GPUs, started here on loopback): static (the peak's replicas
        on dedicated devices, batch work on the rest) and pooled (the same service elastic, sharing
        every device with preemptible batch jobs). One trace hour lasts --day-s / 24 seconds.

        Per arm: p50_ms/p99_ms (gateway latency as the client sees it), failed, gpu_hours (held by
        the replicas) and batch_gpu_hours (batch jobs completed), both in trace hours."""
        from computepool.cli.bench_pool_cmd import _show
        from computepool.client.bench_serve import ServeBenchSettings, run_serve_bench

        try:
            settings = ServeBenchSettings(
                seed=seed, day_s=day_s, peak_rps=peak_rps, gpus=gpus, nodes=nodes, replicas=replicas,
                slots=slots, ms_per_token=ms_per_token, max_tokens=max_tokens,
                target_inflight=target_inflight, min_replicas=min_replicas,
                scale_down_delay_s=scale_down_delay, batch_job_hours=batch_job_hours,
            )  # fmt: skip
        except ValueError as e:
            field, _, why = str(e).partition(": ")
            raise InvalidInput(f"--{field.replace('_', '-')}", why or str(e)) from None

        def say(line: str) -> None:
            if not json_out:
                err_console.print(line, highlight=False, markup=False)

        try:
            out: dict[str, Any] = run_serve_bench(settings, say)
        except RuntimeError as e:  # the bench's own pool did not come up or settle
            raise fail(f"bench serve: {e}", 1) from None
        if json_out:
            _show("", out, True)
            return
        flat = {f"{arm}.{k}": v for arm in ("static", "pooled") for k, v in out[arm].items()}
        _show("Serving benchmark: static vs pooled", {**flat, **out["comparison"]}, False)
