"""Fixtures for the agent's building blocks: real child processes, no GPU needed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.executor import Executor


@pytest.fixture
def executor(tmp_path: Path) -> Iterator[Executor]:
    """An executor without cgroups (rlimits and affinity), so tests never touch the host's cgroups."""
    ex = Executor(tmp_path / "agent", cgroup_base=None, kill_grace_s=2.0)
    yield ex
    for rec in ex.running():
        ex.kill(rec.key, "test teardown", grace_s=0)
    ex.state.close()
