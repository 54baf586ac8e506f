"""Each tenant's own podman network for its containers that publish ports.

A container given ports needs a network (the others get none, or the host's). On podman's
default network every such container shared one bridge, so one tenant's container reached every
port of another tenant's container by its bridge address, not only the published ones. Each
tenant user (so each pool's tenant: their uids differ) now has a bridge network of its own,
`computepool-uid-<uid>`, made on first use with netavark's `isolate` option: no traffic passes
between it and any other isolated network, and its containers reach only each other. The
networks stay (a tenant's next container reuses its network); when podman has no free subnet
left for a new one, the agent removes those no container uses and tries again. Their subnets
go to the agent's host firewall (hostwall.py), which refuses the metadata addresses to traffic
forwarded from them.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable

PREFIX = "computepool-uid-"

Podman = Callable[..., subprocess.CompletedProcess[str]]


class NetworkError(Exception):
    """The tenant's network could not be made: the job cannot publish its ports."""


def network_name(uid: int) -> str:
    return f"{PREFIX}{uid}"


class TenantNetworks:
    """The networks made or found by this agent; `on_subnets` hears each one's subnets once."""

    def __init__(self, podman: Podman, on_subnets: Callable[[list[str]], None] | None = None) -> None:
        self.podman = podman
        self.on_subnets = on_subnets
        self._ready: set[str] = set()
        self._lock = threading.Lock()

    def ensure(self, uid: int) -> str:
        """The tenant's network, made when it does not exist yet; NetworkError if podman refuses."""
        name = network_name(uid)
        with self._lock:
            if name in self._ready:
                return name
            if self.podman(["network", "exists", name], timeout=30).returncode != 0:
                create = ["network", "create", "--disable-dns", "--opt", "isolate=true", name]
                done = self.podman(create, timeout=60)
                if done.returncode != 0 and self._exists(name) is False:
                    self.prune()  # podman's free subnets may be used up by networks nobody uses now
                    done = self.podman(create, timeout=60)
                # another agent of this host may have made it meanwhile
                if done.returncode != 0 and self._exists(name) is False:
                    lines = (done.stderr or done.stdout).strip().splitlines() or [""]
                    raise NetworkError(f"cannot make the tenant's network {name}: {lines[-1]}")
            self._ready.add(name)
        self._announce([name])
        return name

    def _exists(self, name: str) -> bool:
        return self.podman(["network", "exists", name], timeout=30).returncode == 0

    def prune(self) -> None:
        """Remove the pool's tenant networks no container uses (podman refuses the others)."""
        for name in self.existing():
            self.podman(["network", "rm", name], timeout=60)
            self._ready.discard(name)

    def existing(self) -> list[str]:
        """The pool's tenant networks on this host (an agent restarted while their containers ran)."""
        done = self.podman(["network", "ls", "--format", "{{.Name}}"], timeout=30)
        return [n for n in done.stdout.split() if n.startswith(PREFIX)] if done.returncode == 0 else []

    def announce_existing(self) -> None:
        self._announce(self.existing())

    def _announce(self, names: list[str]) -> None:
        if self.on_subnets is None or not names:
            return
        fmt = "{{range .Subnets}}{{.Subnet}} {{end}}"
        done = self.podman(["network", "inspect", "--format", fmt, *names], timeout=30)
        subnets = [s for s in done.stdout.split() if "." in s]  # IPv4: what podman gives by default
        if subnets:
            self.on_subnets(subnets)
