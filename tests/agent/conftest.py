"""Fixtures for the agent's building blocks: real child processes, no GPU needed."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.container import Podman
from computepool.agent.executor import Executor, SandboxConfig
from computepool.agent.tenants import remove_tenant_user


@pytest.fixture
def executor(tmp_path: Path) -> Iterator[Executor]:
    """An executor without cgroups (rlimits and affinity), so tests never touch the host's cgroups."""
    ex = Executor(tmp_path / "agent", cgroup_base=None, kill_grace_s=2.0)
    yield ex
    for rec in ex.running():
        ex.kill(rec.key, "test teardown", grace_s=0)
    ex.state.close()


@pytest.fixture
def container_executor(image: str) -> Iterator[tuple[Executor, str]]:
    """A sandboxing executor and a fresh tenant; its containers, data and user go at teardown.

    The data dir is under /var/tmp: jobs' users must pass through it, which pytest's 0700 tmp
    dirs would forbid.
    """
    data = Path("/var/tmp") / f"cpool-ctr-{uuid.uuid4().hex[:8]}"
    data.mkdir()
    tenant = f"t{uuid.uuid4().hex[:8]}"
    ex = Executor(data / "agent", cgroup_base=None, kill_grace_s=2.0, sandbox=SandboxConfig())
    yield ex, tenant
    for rec in ex.running():
        ex.kill(rec.key, "teardown", grace_s=0)
    engine = Podman(data / "agent")
    for key in engine.all_keys():
        engine.remove(key)
    ex.state.close()
    shutil.rmtree(data, ignore_errors=True)
    remove_tenant_user(tenant)
