"""Which host ports a container job may publish: those of the operator's `--publish-ports` range.

Rootful podman binds a published port as root, so without a range a tenant could take a
privileged port (`--port 81`) or one the pool gives out itself (a service replica's, a gang's
master port, a cooperative service's RPC server's) and receive the traffic meant for it. The
range is checked at admission (POST /allocations, a service's request: 422 naming `ports`); the
settings keep it apart from the gang, service and RPC ranges and above 1023. A published port
is host port = container port, bound on the node's address only (the agent's `--publish-ports`
checks again where it runs; a replica's own port, which the control plane adds, is exempt).
"""

from __future__ import annotations

from collections.abc import Iterable

from computepool.server.errors import Invalid
from computepool.server.settings import ServerSettings


def check(ports: Iterable[int] | None, settings: ServerSettings) -> None:
    """Raise Invalid (422 naming `ports`) for a port outside the publish range."""
    lo, hi = settings.publish_port_min, settings.publish_port_max
    bad = sorted(p for p in ports or () if not lo <= p <= hi)
    if bad:
        why = "a privileged port" if bad[0] < 1024 else "outside it"
        raise Invalid(
            f"ports: {bad[0]} cannot be published: containers publish ports {lo}-{hi} only ({why})", "ports"
        )
