"""What the executor is asked to run (`JobSpec`), what it found after a restart, and the files of a run dir.

Apart from the executor so that the launchers (sandbox, container) and the agent's loop can name a
job without importing the machinery that runs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from computepool.agent.localstate import JobRecord, job_key

DEFAULT_CGROUP_BASE = Path("/sys/fs/cgroup/computepool")
EXIT_FILE = "exit_code"
STDOUT_LOG = "stdout.log"
STDERR_LOG = "stderr.log"


@dataclass(frozen=True)
class JobSpec:
    """What to run for one attempt of an allocation. 0 means no limit for CPU or memory, and the
    agent's own limit for processes."""

    allocation_id: str
    attempt: int
    command: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    cpu_milli: int = 0
    memory_mib: int = 0
    pids_max: int = 0
    user: str | None = None
    cwd: str | None = None
    uses_gpu: bool = False  # GPU runtimes reserve vast address space: no RLIMIT_AS for them
    tenant: str = ""  # whose job: the sandbox runs it as that tenant's user
    image: str | None = None  # None: a sandboxed process; else an OCI container through podman
    image_digest: str | None = None  # the image id the pool pinned `image` to: what runs
    private_network: bool = False  # the syscall filter lets it make one user + network namespace
    host_network: bool = False  # a process job keeps the node's network (jobnet.needs_host_network)
    ports: tuple[int, ...] = ()  # container ports to publish (containers have no network otherwise)
    device_uuids: tuple[str, ...] = ()  # the slice's devices: a container sees only these
    device_nodes: tuple[str, ...] = ()  # their device files where the backend found them (not NVIDIA's)
    stdin: str | None = None  # a file the command reads as its stdin (default /dev/null)

    @property
    def key(self) -> str:
        return job_key(self.allocation_id, self.attempt)

    @property
    def container_host_network(self) -> bool:
        """A container on the host's network: a function's worker (it calls the control plane back,
        which may listen on the node's loopback) given no ports."""
        return bool(self.image) and not self.ports and "CPOOL_WORKER_TOKEN" in self.env


@dataclass(frozen=True)
class AdoptReport:
    """What a (re)started executor found in its local state."""

    adopted: list[JobRecord]
    ended: list[JobRecord]
