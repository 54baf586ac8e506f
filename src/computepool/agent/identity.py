"""What sets one agent apart from the others on the same host: its data dir.

Node names and ids are the pool's: two pools on one host may each have a node `gpu1` and an
allocation 1. An agent's data dir, though, is its own (it holds it locked, core/dirlock.py), so
whatever the agent names on the host outside that dir (its job cgroups, its podman containers)
carries the same few hex digits of the dir's path, and one agent never takes another's for its own.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

_NAME_BAD = re.compile(r"[^a-z0-9_.-]+")


def agent_id(data_dir: Path) -> str:
    """8 hex digits of the data dir's resolved path (the same as the podman containers' label)."""
    return hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:8]


def node_key(data_dir: Path, name: str = "") -> str:
    """`<node name>-<agent_id>`, e.g. `gpu1-3f2a9c01`: readable by the operator, unique on the host."""
    stem = _NAME_BAD.sub("-", name.lower()).strip("-._")[:48]
    return f"{stem or 'node'}-{agent_id(data_dir)}"
