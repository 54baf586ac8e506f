"""`cpool bench coop`: cooperative inference on a pool of its own (tiny model, agents, one impostor)."""

from __future__ import annotations

import typer


def register(bench_app: typer.Typer) -> None:
    """Filled in by the benchmark work."""
