"""The node's firewall for tenants' sockets on the node's own network (nftables, by uid).

Most process jobs have a network namespace of their own (jobnet.py), whose routes refuse the
clouds' metadata addresses and whose loopback is theirs. Some keep the node's network: service
replicas, gang members, function workers of a control plane on the node's loopback, containers
on the host network. Those run as the tenants' users (the agent's `--uid-range`), so the kernel
can tell their packets apart by the sending socket's owner: a root agent installs one nftables
table of its own (`inet cpool_<agent id>_<pid>`) whose output chain, for those uids alone,

- refuses every connection to the instance metadata addresses (169.254.0.0/16, 100.100.100.200,
  fd00:ec2::254), which answer with the machine's cloud credentials; its forward chain does
  the same for the tenants' container networks (container_net.py);
- refuses every connection to those container networks' addresses: their bridges are the node's
  own, so a job on the node's network reached every port of any tenant's container there, not
  only the published ones (a published port, translated by the node from its own address, is
  not refused: its original destination is not a container's). The same holds for the
  slirp4netns of every job with a network of its own (root, but in `jobnet.SLIRP_GID`);
- refuses new TCP connections and UDP flows to the node's loopback (127.0.0.0/8, ::1) on a port
  where a system user's service listens there (a database, a cache: any uid but root's and the
  tenants'), or where another tenant's process does (a Jupyter or debug port it thought private).
  A tenant still reaches its own loopback listeners, root's services (the pool's control plane
  is one; they authenticate: `--protect-ports` refuses named ones too) and DNS (port 53).
  Tenants' listeners are told apart by bound address and family as well as port: a listener of
  one's own on the same port at another loopback address (127.0.0.2, ::1) opens nothing of
  another's; an address and port two tenants hold at once is refused to both.

What listens where is read from /proc/net/{tcp,udp}{,6} (owner uid, bound address) every
`REFRESH_S`, and the table's sets are replaced in one transaction when it changed: a service that
starts listening is refused to tenants within that long. Only loopback-bound or wildcard
listeners count: one on the node's other addresses is as reachable from any host of its network,
which is the network's firewall's business. The table goes when the agent stops; one a killed
agent left is removed by the next agent to start on the host (its pid, in the name, is gone).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from computepool.agent.jobnet import SLIRP_GID

log = logging.getLogger("computepool.agent")

REFRESH_S = 2.0
METADATA_V4 = ("169.254.0.0/16", "100.100.100.200")
METADATA_V6 = ("fd00:ec2::254",)
DNS_PORT = 53
_LISTEN, _UNCONNECTED = "0A", "07"  # TCP_LISTEN; a bound UDP socket (TCP_CLOSE) in /proc/net/udp
_TABLE = re.compile(r"^cpool_[0-9a-f]{8}_([0-9]+)$")


@dataclass(frozen=True)
class Listener:
    """A socket that takes connections (TCP) or datagrams (UDP) on the node's loopback, for one
    family: a dual-stack `[::]` listener (or one that may be: /proc does not say) is two."""

    proto: str  # "tcp" or "udp"
    port: int
    uid: int
    family: int = 4  # 4 or 6: the packets that reach it
    address: str = ""  # the loopback address it is bound to; "" for the wildcard


def _address(hexed: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hexed)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw)


def _reached_as(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> list[tuple[int, str]]:
    """(family, address) of the loopback packets a socket bound to `ip` takes ("" = any)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        return [(4, ""), (6, "")] if ip.version == 6 else [(4, "")]
    return [(ip.version, str(ip))] if ip.is_loopback else []


def loopback_listeners(proc: Path = Path("/proc")) -> set[Listener]:
    """The TCP LISTEN and bound UDP sockets a connection to the node's loopback reaches (bound
    to a loopback address or to a wildcard), with their owners, in the reader's namespace."""
    found: set[Listener] = set()
    for table, proto, state in (
        ("tcp", "tcp", _LISTEN),
        ("tcp6", "tcp", _LISTEN),
        ("udp", "udp", _UNCONNECTED),
        ("udp6", "udp", _UNCONNECTED),
    ):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:  # no IPv6 on this node
            continue
        for line in lines:
            f = line.split()
            if len(f) < 8 or f[3] != state:
                continue
            with contextlib.suppress(ValueError):
                addr, port = f[1].rsplit(":", 1)
                for family, bound in _reached_as(_address(addr)):
                    found.add(Listener(proto, int(port, 16), int(f[7]), family, bound))
    return found


Key = tuple[int, str, str, int]  # family, bound address ("" = any), proto, port


@dataclass(frozen=True)
class Plan:
    """The table's sets: ports refused to every tenant; where tenants listen, and the one
    tenant uid that may reach each such place (none where two tenants listen there)."""

    refused: frozenset[tuple[str, int]]
    tenant: frozenset[Key]
    owner: tuple[tuple[Key, int], ...]


def plan(
    listeners: Iterable[Listener], uid_range: tuple[int, int], exempt: set[int], protect: set[int]
) -> Plan:
    """Who may reach what: a system user's listener (not root, not a tenant) is refused to
    tenants unless its port is exempt (DNS, the control plane's); root's only where protected; a
    tenant's own listener is refused to the other tenants, by its address as well as its port (a
    port alone let a tenant open another's listener by listening on that port elsewhere)."""
    lo, hi = uid_range
    refused: set[tuple[str, int]] = set()
    owners: dict[Key, set[int]] = {}
    for s in listeners:
        if lo <= s.uid <= hi:
            owners.setdefault((s.family, s.address, s.proto, s.port), set()).add(s.uid)
        elif (s.uid != 0 and s.port not in exempt) or (s.uid == 0 and s.port in protect):
            refused.add((s.proto, s.port))
    owner = tuple(sorted((k, next(iter(u))) for k, u in owners.items() if len(u) == 1))
    return Plan(frozenset(refused), frozenset(owners), owner)


def local_ports(urls: Iterable[str]) -> set[int]:
    """The ports of those URLs whose host is this node (loopback or one of its addresses)."""
    import psutil  # noqa: PLC0415 - only a root agent with nftables asks

    mine = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    ports: set[int] = set()
    for url in urls:
        with contextlib.suppress(ValueError):
            parts = urlsplit(url)
            host = parts.hostname or ""
            port = parts.port or (443 if parts.scheme == "https" else 80)
            if host == "localhost" or host in mine or ipaddress.ip_address(host).is_loopback:
                ports.add(port)
    return ports


def _elements(items: Iterable[tuple[object, ...]]) -> str:
    return ", ".join(" . ".join(str(x) for x in item) for item in sorted(items, key=str))


class HostWall:
    """One agent's nftables table; `install` once, then `start` keeps its sets current."""

    def __init__(
        self,
        agent_id: str,
        uid_range: tuple[int, int],
        exempt_ports: Callable[[], set[int]] = set,
        protect_ports: Iterable[int] = (),
        *,
        nft: str | None = None,
        proc: Path = Path("/proc"),
    ) -> None:
        self.table = f"cpool_{agent_id}_{os.getpid()}"
        self.uid_range = uid_range
        self.exempt_ports = exempt_ports  # the control plane's ports (its replicas change)
        self.protect = set(protect_ports)
        self.nft = nft or shutil.which("nft") or ""
        self.proc = proc
        self._plan: Plan | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run_nft(self, script: str) -> None:
        done = subprocess.run(
            [self.nft, "-f", "-"], input=script, capture_output=True, text=True, timeout=30, check=False
        )
        if done.returncode != 0:
            raise OSError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "nft failed")

    def install(self) -> str:
        """Make the table (replacing one of this name); "" when done, else why not."""
        if os.geteuid() != 0:
            return "the agent is not root"
        if not self.nft:
            return "nft (nftables) not installed"
        self.sweep()
        lo, hi = self.uid_range
        uids = f"{lo}-{hi}" if hi > lo else str(lo)
        t = self.table
        refuse = "reject with icmpx admin-prohibited"  # the call fails at once (EHOSTUNREACH)
        by_port = "meta l4proto . th dport"
        script = f"""
table inet {t} {{}}
delete table inet {t}
table inet {t} {{
  set metadata4 {{ type ipv4_addr; flags interval; elements = {{ {", ".join(METADATA_V4)} }}; }}
  set metadata6 {{ type ipv6_addr; elements = {{ {", ".join(METADATA_V6)} }}; }}
  set refused {{ type inet_proto . inet_service; }}
  set at4 {{ type ipv4_addr . inet_proto . inet_service; }}
  set owned4 {{ type uid . ipv4_addr . inet_proto . inet_service; }}
  set at6 {{ type ipv6_addr . inet_proto . inet_service; }}
  set owned6 {{ type uid . ipv6_addr . inet_proto . inet_service; }}
  set any4 {{ type inet_proto . inet_service; }}
  set owned_any4 {{ type uid . inet_proto . inet_service; }}
  set any6 {{ type inet_proto . inet_service; }}
  set owned_any6 {{ type uid . inet_proto . inet_service; }}
  set containers4 {{ type ipv4_addr; flags interval; }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    ip saddr @containers4 ip daddr @metadata4 {refuse}
  }}
  chain out {{
    type filter hook output priority filter; policy accept;
    meta skgid {SLIRP_GID} ct state new ct original ip daddr @containers4 {refuse}
    meta skuid != {uids} accept
    ct state != new accept
    ip daddr @metadata4 {refuse}
    ip6 daddr @metadata6 {refuse}
    ct original ip daddr @containers4 {refuse}
    ip daddr 127.0.0.0/8 {by_port} @refused {refuse}
    ip6 daddr ::1 {by_port} @refused {refuse}
    ip daddr 127.0.0.0/8 ip daddr . {by_port} @at4 meta skuid . ip daddr . {by_port} != @owned4 {refuse}
    ip6 daddr ::1 ip6 daddr . {by_port} @at6 meta skuid . ip6 daddr . {by_port} != @owned6 {refuse}
    ip daddr 127.0.0.0/8 {by_port} @any4 meta skuid . {by_port} != @owned_any4 {refuse}
    ip6 daddr ::1 {by_port} @any6 meta skuid . {by_port} != @owned_any6 {refuse}
  }}
}}
"""
        try:
            self._run_nft(script)
            self.refresh()
        except (OSError, subprocess.SubprocessError) as e:
            return f"nft refused the table: {e}"
        return ""

    def refresh(self) -> None:
        """Read who listens now; replace the sets in one transaction if that changed."""
        exempt = {DNS_PORT, *self.exempt_ports()}
        new = plan(loopback_listeners(self.proc), self.uid_range, exempt, self.protect)
        if new == self._plan:
            return
        sets: dict[str, set[tuple[object, ...]]] = {"refused": set(new.refused)}
        for name in ("at4", "owned4", "at6", "owned6", "any4", "owned_any4", "any6", "owned_any6"):
            sets[name] = set()
        for family, address, proto, port in new.tenant:
            at = (address, proto, port) if address else (proto, port)
            sets[f"at{family}" if address else f"any{family}"].add(at)
        for (family, address, proto, port), uid in new.owner:
            sets[f"owned{family}" if address else f"owned_any{family}"].add(
                (uid, address, proto, port) if address else (uid, proto, port)
            )
        lines = []
        for name, items in sets.items():
            lines.append(f"flush set inet {self.table} {name}")
            if items:
                lines.append(f"add element inet {self.table} {name} {{ {_elements(items)} }}")
        self._run_nft("\n".join(lines) + "\n")
        self._plan = new

    def add_container_subnets(self, subnets: list[str]) -> None:
        """Tenants' container networks (container_net.py): the metadata addresses are refused to
        what they forward too. Called from the thread that starts a container, before it runs."""
        try:
            self._run_nft(f"add element inet {self.table} containers4 {{ {', '.join(subnets)} }}\n")
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("host firewall: could not add container networks %s: %s", subnets, e)

    def sweep(self) -> list[str]:
        """Delete the tables of agents no longer running on this host (a killed agent's)."""
        done = subprocess.run(
            [self.nft, "list", "tables", "inet"], capture_output=True, text=True, timeout=30, check=False
        )
        gone = []
        for line in done.stdout.splitlines():
            name = line.removeprefix("table inet ").strip()
            m = _TABLE.match(name)
            if m and name != self.table and not (self.proc / m.group(1)).exists():
                with contextlib.suppress(OSError, subprocess.SubprocessError):
                    self._run_nft(f"delete table inet {name}\n")
                    gone.append(name)
        return gone

    def _loop(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                self.refresh()
            except (OSError, subprocess.SubprocessError) as e:
                log.warning("host firewall: could not update table %s: %s", self.table, e)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="cpool-hostwall", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop refreshing and delete the table."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            self._run_nft(f"delete table inet {self.table}\n")
