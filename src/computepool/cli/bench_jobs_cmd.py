"""`cpool bench jobs`: tiny jobs end to end on a pool of its own, and Slurm side by side."""

from __future__ import annotations

import signal
import sys
from typing import Annotated

import typer

from computepool.cli.common import err_console, fail, friendly_errors


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("jobs")
    @friendly_errors
    def jobs(
        count: Annotated[
            int, typer.Option("--jobs", min=1, max=100_000, help="Jobs of the throughput run.")
        ] = 500,
        samples: Annotated[
            int, typer.Option("--samples", min=1, max=10_000, help="`cpool run` calls timed for each figure.")
        ] = 20,
        history: Annotated[
            int,
            typer.Option("--history", min=0, max=1_000_000, help="Jobs the agent has run before after_20k."),
        ] = 20_000,
        history_batch: Annotated[
            int, typer.Option("--history-batch", min=1, max=100_000, help="Jobs per batch of the fill.")
        ] = 1000,
        history_minutes: Annotated[
            float | None,
            typer.Option(
                "--history-minutes",
                min=0,
                max=24 * 60,
                help="Start no fill batch after this long (after_20k.history.jobs says what was reached).",
            ),
        ] = None,
        idle_seconds: Annotated[
            float, typer.Option("--idle-seconds", min=0.5, max=3600, help="Idle window the CPU is read over.")
        ] = 20.0,
        slots: Annotated[
            int,
            typer.Option("--slots", min=1, max=1000, help="Jobs at once (each 1/SLOTS of the node's CPUs)."),
        ] = 20,
        slurm: Annotated[
            bool, typer.Option("--slurm/--no-slurm", help="Also time a private Slurm when slurmctld is here.")
        ] = True,
        slurm_defaults: Annotated[
            bool,
            typer.Option(
                "--slurm-defaults/--no-slurm-defaults",
                help="Also run Slurm with its default SchedulerParameters (slurm.default_scheduler).",
            ),
        ] = True,
        json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """Start `cpool up --simulate 1xA100-80GB` (temp dir, free loopback port) and time tiny jobs.

        e2e_*: `cpool run --no-code --cpus 0.1 -- true` as a subprocess on the idle pool;
        cli_submit_ms: the same with -d (p50); jobs_per_s: --jobs `true` jobs through the API, --slots
        at once, submitted then drained (first submit → none left live); daemon_cpu_s_per_100_jobs:
        the server's and agent's own CPU over that run (the jobs' and their launchers' is in detail);
        agent_idle_cpu_s_per_min over --idle-seconds. after_20k: e2e p50 and idle CPU again once the
        agent has run --history jobs (filled in batches, said in after_20k.history). slurm: the
        same figures from a private munged + slurmctld + slurmd (`srun -n1 true`, `sbatch --wrap
        true`) when slurmctld is on the PATH, else null.
        """
        from computepool.cli.bench_pool_cmd import _show
        from computepool.client.bench_jobs import JobsSuite, run_jobs_suite
        from computepool.client.errors import PoolError, ServerUnreachable

        suite = JobsSuite(
            jobs=count,
            samples=samples,
            history=history,
            history_batch=history_batch,
            history_max_s=history_minutes * 60 if history_minutes is not None else None,
            idle_s=idle_seconds,
            slots=slots,
            slurm=slurm,
            slurm_defaults=slurm_defaults,
        )

        def say(what: str) -> None:
            if not json_out:
                err_console.print(what, highlight=False)

        # SIGTERM unwinds like Ctrl-C, so the pool and the Slurm daemons it started are stopped
        signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))
        try:
            out = run_jobs_suite(suite, say)
        except (RuntimeError, PoolError, ServerUnreachable) as e:  # the local pool or Slurm failed
            raise fail(f"bench jobs: {e}") from None
        _show("Job benchmark", out, json_out)
