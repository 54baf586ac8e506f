"""A sandboxing executor as a root agent has it, in a data dir of its own under /var/tmp (tenants'
users must pass it); its jobs, its containers if asked, and its data go at the end."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from computepool.agent.container import Podman
from computepool.agent.executor import Executor, SandboxConfig


@contextmanager
def sandbox_node(
    prefix: str, sandbox: SandboxConfig, *, mode: int = 0o777, containers: bool = False, **executor: Any
) -> Iterator[Executor]:
    data = Path("/var/tmp") / f"cpool-{prefix}-{uuid.uuid4().hex[:8]}"
    data.mkdir(mode=mode)
    ex = Executor(data / "agent", kill_grace_s=1.0, sandbox=sandbox, **executor)
    try:
        yield ex
    finally:
        for rec in ex.running():
            ex.kill(rec.key, "teardown", grace_s=0)
        if containers:
            engine = Podman(data / "agent")
            for key in engine.all_keys():
                engine.remove(key)
        ex.close()
        ex.state.close()
        shutil.rmtree(data, ignore_errors=True)
