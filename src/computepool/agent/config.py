"""The agent's settings (`AgentConfig`, what `cpool agent` passes in) and its one fatal error.

`AgentFatal` is what only the operator can fix; its exit code tells `cpool up` whether a fresh join
token would help (`EXIT_CREDENTIAL_REFUSED`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from computepool.agent.jobspec import DEFAULT_CGROUP_BASE
from computepool.agent.sandbox import SandboxConfig

EXIT_FATAL = 2
EXIT_CREDENTIAL_REFUSED = 3  # `cpool up` answers this one with a fresh join token
DEFAULT_DISCOVERY_PORT = 5757
DEFAULT_PUBLISH_PORTS = (20000, 28999)  # as the server's --publish-ports


class AgentFatal(Exception):
    """Something only the operator can fix; the CLI prints it as one line and exits non-zero."""

    def __init__(self, message: str, code: int = EXIT_FATAL) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class DiscoveryOptions:
    """`cpool agent --discovery …`: LAN discovery (agent/discovery_link.py)."""

    address: str | None = None  # None: --address when it is an IP, else the route to the server
    port: int = DEFAULT_DISCOVERY_PORT  # UDP + TCP probe port
    peers: tuple[str, ...] = ()  # unicast fallback where multicast is blocked, "HOST:PORT"
    mdns: bool = True
    report_every_s: float = 5.0  # a changed view is reported within this long
    refresh_every_s: float = 30.0  # an unchanged one this often (fresh last_seen)
    announce_every_s: float = 5.0
    measure_every_s: float = 30.0


@dataclass(frozen=True)
class AgentConfig:
    server: str
    data_dir: Path
    join_token: str | None = None
    ca: Path | None = None  # the control plane's CA (PEM); else a pinned or the system's (api.server_verify)
    name: str | None = None
    address: str | None = None  # where gang peers reach this node; None: as the control plane sees it
    simulate: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    cgroup_base: Path | None = DEFAULT_CGROUP_BASE
    kill_grace_s: float = 10.0
    poll_wait_s: float = 20.0
    tick_s: float = 0.5
    max_backoff_s: float = 5.0
    log_chunk_bytes: int = 256 * 1024
    code_max_bytes: int = 8 << 30  # what one code archive may unpack to (agent/blobs.py)
    watchdog_interval_s: float = 2.0
    fence_s: float | None = None  # None: as long as the control plane's lost-node timeout allows
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # users, namespaces (sandbox.py)
    discovery: DiscoveryOptions | None = None  # None: no LAN discovery
    # host ports a container job may publish (on the node's address; a replica's own port aside)
    publish_ports: tuple[int, int] = DEFAULT_PUBLISH_PORTS
    # root's own loopback services the host firewall refuses to tenants too (hostwall.py)
    protect_ports: tuple[int, ...] = ()
