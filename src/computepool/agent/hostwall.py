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
- refuses the containers of the tenants' networks what it refuses tenants' sockets on the node's
  own addresses (their bridge's address and the node's others are the node's: its listeners on
  every address took a container's connections): a system user's service, any tenant's listener
  (the container's own tenant's too: its traffic carries no uid), root's services and DNS open;
- refuses every connection to containers' addresses: a container network's bridge is the
  node's own, so a job on the node's network reached every port of any tenant's container there,
  not only the published ones. Its own networks' subnets are refused, and every podman bridge
  (`podman*`, `cni-podman*`: other agents' and other pools' networks too) unless the connection
  is to a published port (translated by the node from its own address: `ct status dnat`);
- refuses new TCP connections and UDP flows to any of the node's own addresses (loopback and
  the others: `fib daddr type local`) on a port where a system user's service listens there (a
  database, a cache: any uid but root's and the tenants'), or where another tenant's process does
  (a Jupyter or debug port it thought private). A job on the node is the node itself to such a
  service, which often trusts it for that (a `samehost` rule), so its LAN address is refused like
  127.0.0.1. A tenant still reaches its own listeners, root's services (the pool's control plane
  is one; they authenticate: `--protect-ports` refuses named ones too) and DNS (port 53).
  Tenants' listeners are told apart by bound address and family as well as port: a listener of
  one's own on the same port at another address (127.0.0.2, ::1) opens nothing of another's; an
  address and port two tenants hold at once is refused to both. A `[::]` listener that takes
  IPv6 alone (`IPV6_V6ONLY`, which /proc does not show: read through `ss` when a tenant has one)
  holds only IPv6;
- does the same for slirp4netns, the user-mode network of every job with a network of its own
  (root, but in its tenant's group, or `jobnet.SLIRP_GID`): it connects for whichever tenant's
  job, so every system user's and tenant's listener on the node's addresses and every container
  is refused to it;
- caps the connections and UDP flows one tenant user (and one container of a tenant's network,
  to other hosts and to the node's own addresses alike, and the slirp4netns of one tenant's jobs,
  by their group) has in the node's connection tracking at once (`FLOWS_PER_SOURCE`): that table
  is the node's one, charged to no one, and full it drops every new connection on the node.

What listens where is read from /proc/net/{tcp,udp}{,6} (owner uid, bound address) every
`REFRESH_S`, and the table's sets are replaced in one transaction when it changed: a service that
starts listening is refused to tenants within that long. The rules hold for every packet a
tenant's socket sends on a connection it opened, not for its first alone: a connection made in
that moment, before the listener was known, breaks at the next refresh instead of staying open
(replies on connections others opened to a tenant's own listeners pass). The table goes when
the agent stops with no job left running; one that jobs outlive (a stopped agent leaves them
running for the next to adopt: without it they reached everything it refuses until then), or a
killed agent's, is removed by the next agent to start on the host (its pid, in the name, is
gone) once that agent's own table is in.
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
# The node's connection tracking is one table (nf_conntrack_max, ~262k entries) whose entries are
# charged to no one: a UDP socket sending to 10,000 ports made 10,000 in under a second, and once
# it is full the node drops every new connection, its agent's heartbeats too.
FLOWS_PER_SOURCE = 8192
METADATA_V4 = ("169.254.0.0/16", "100.100.100.200")
METADATA_V6 = ("fd00:ec2::254",)
DNS_PORT = 53
_LISTEN, _UNCONNECTED = "0A", "07"  # TCP_LISTEN; a bound UDP socket (TCP_CLOSE) in /proc/net/udp
_TABLE = re.compile(r"^cpool_[0-9a-f]{8}_([0-9]+)$")
_INODE = re.compile(r"\bino:([0-9]+)")
BRIDGES = ("podman*", "cni-podman*")  # the bridges of podman's networks (netavark, CNI)


@dataclass(frozen=True)
class Listener:
    """A socket that takes connections (TCP) or datagrams (UDP) on one of the node's addresses, for
    one family: a dual-stack `[::]` listener is two."""

    proto: str  # "tcp" or "udp"
    port: int
    uid: int
    family: int = 4  # 4 or 6: the packets that reach it
    address: str = ""  # the address it is bound to; "" for the wildcard


def _address(hexed: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hexed)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw)


def _reached_as(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address, v6only: bool = False
) -> list[tuple[int, str]]:
    """(family, address) of the packets a socket bound to `ip` takes ("" = any)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        return [(6, "")] if v6only else [(4, ""), (6, "")] if ip.version == 6 else [(4, "")]
    return [(ip.version, str(ip))]


def v6only_inodes(ss: str | None = None) -> set[int] | None:
    """The inodes of this namespace's listening sockets that take IPv6 alone, from iproute2's `ss`
    (its socket diagnostics carry the flag /proc/net leaves out); None when it cannot tell."""
    ss = ss or shutil.which("ss") or ""
    if not ss:
        return None
    try:
        done = subprocess.run(
            [ss, "-H", "-l", "-n", "-e", "-t", "-u", "-6"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    found = set()
    for line in done.stdout.splitlines():
        if "v6only:1" in line and (m := _INODE.search(line)):
            found.add(int(m.group(1)))
    return found


def local_listeners(proc: Path = Path("/proc"), uid_range: tuple[int, int] | None = None) -> set[Listener]:
    """The TCP LISTEN and bound UDP sockets a connection to one of the node's addresses reaches,
    with their owners, in the reader's namespace. Whether a tenant's (in `uid_range`) `[::]`
    listener takes IPv4 too is asked of `ss`; any other `[::]` counts for both families."""
    rows: list[tuple[str, bool, list[str]]] = []
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
        rows += [
            (proto, table.endswith("6"), f) for f in map(str.split, lines) if len(f) >= 10 and f[3] == state
        ]
    lo, hi = uid_range or (1, 0)
    ask = any(six and set(f[1].rsplit(":", 1)[0]) == {"0"} and f[7].isdigit() and lo <= int(f[7]) <= hi
              for _, six, f in rows)  # fmt: skip
    v6only = (v6only_inodes() or set()) if ask else set()
    found: set[Listener] = set()
    for proto, _six, f in rows:
        with contextlib.suppress(ValueError):
            addr, port = f[1].rsplit(":", 1)
            for family, bound in _reached_as(_address(addr), int(f[9]) in v6only):
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
        flows: int = FLOWS_PER_SOURCE,
    ) -> None:
        """`flows`: connections and UDP flows one tenant user (or one container) may have open at
        once through the node's connection tracking."""
        self.table = f"cpool_{agent_id}_{os.getpid()}"
        self.flows = flows
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
        lo, hi = self.uid_range
        uids = f"{lo}-{hi}" if hi > lo else str(lo)
        t = self.table
        refuse = "reject with icmpx admin-prohibited"  # the call fails at once (EHOSTUNREACH)
        by_port = "meta l4proto . th dport"
        # a published port's connection is translated to the container's address: that one may pass
        bridges = "\n".join(f'    oifname "{b}" ct status & dnat == 0 {refuse}' for b in BRIDGES)
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
  set flows_uid {{ type uid; size 65535; flags dynamic; }}
  set flows_src {{ type ipv4_addr; size 65535; flags dynamic; }}
  set flows_slirp {{ type gid; size 65535; flags dynamic; }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    ip saddr @containers4 ip daddr @metadata4 {refuse}
    ip saddr @containers4 ct state new add @flows_src {{ ip saddr ct count over {self.flows} }} {refuse}
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    ip saddr @containers4 ct state new add @flows_src {{ ip saddr ct count over {self.flows} }} {refuse}
    ip saddr @containers4 ct direction original jump from_containers
  }}
  chain from_containers {{
    fib daddr type local {by_port} @refused {refuse}
    fib daddr type local ip daddr . {by_port} @at4 {refuse}
    fib daddr type local {by_port} @any4 {refuse}
  }}
  chain slirp {{
    ct state new add @flows_slirp {{ meta skgid ct count over {self.flows} }} {refuse}
    ip daddr @metadata4 {refuse}
    ip6 daddr @metadata6 {refuse}
    ct original ip daddr @containers4 {refuse}
{bridges}
    fib daddr type local {by_port} @refused {refuse}
    fib daddr type local ip daddr . {by_port} @at4 {refuse}
    fib daddr type local ip6 daddr . {by_port} @at6 {refuse}
    meta nfproto ipv4 fib daddr type local {by_port} @any4 {refuse}
    meta nfproto ipv6 fib daddr type local {by_port} @any6 {refuse}
  }}
  chain out {{
    type filter hook output priority filter; policy accept;
    meta skuid 0 meta skgid {{ {SLIRP_GID}, {uids} }} ct direction original jump slirp
    meta skuid != {uids} accept
    ct state new add @flows_uid {{ meta skuid ct count over {self.flows} }} {refuse}
    ct direction reply accept
    ip daddr @metadata4 {refuse}
    ip6 daddr @metadata6 {refuse}
    ct original ip daddr @containers4 {refuse}
{bridges}
    fib daddr type local {by_port} @refused {refuse}
    fib daddr type local ip daddr . {by_port} @at4 meta skuid . ip daddr . {by_port} != @owned4 {refuse}
    fib daddr type local ip6 daddr . {by_port} @at6 meta skuid . ip6 daddr . {by_port} != @owned6 {refuse}
    meta nfproto ipv4 fib daddr type local {by_port} @any4 meta skuid . {by_port} != @owned_any4 {refuse}
    meta nfproto ipv6 fib daddr type local {by_port} @any6 meta skuid . {by_port} != @owned_any6 {refuse}
  }}
}}
"""
        try:
            self._run_nft(script)
            self.refresh()
            self.sweep()  # only now: until this table is in, the one a stopped agent left holds its jobs
        except (OSError, subprocess.SubprocessError) as e:
            return f"nft refused the table: {e}"
        return ""

    def refresh(self) -> None:
        """Read who listens now; replace the sets in one transaction if that changed."""
        exempt = {DNS_PORT, *self.exempt_ports()}
        new = plan(local_listeners(self.proc, self.uid_range), self.uid_range, exempt, self.protect)
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

    def close(self, keep: bool = False) -> None:
        """Stop refreshing and delete the table, unless `keep` (jobs run on without the agent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if keep:
            return
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            self._run_nft(f"delete table inet {self.table}\n")
