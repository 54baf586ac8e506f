"""`cpool peers`: the LAN peers the nodes' discovery found, and why any was rejected."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Filled in by the discovery work."""
