"""Three hosts on one LAN, on one machine, for the discovery tests: three network namespaces whose
veth pairs meet on a bridge in a fourth namespace, so that multicast (mDNS) from one reaches the
others as it would on a real switch, and nothing reaches this machine's own network.

Where namespaces cannot be made (not root, no CAP_NET_ADMIN, no `ip`; or CPOOL_TEST_NETNS=0), the
hosts fall back to loopback addresses 127.0.0.2-4 of this machine's one stack, where multicast does
not travel: `Lan.multicast` is False and the tests use unicast discovery only. netns.py makes the
two-host pairs of the gang tests; this module adds the bridge those lack.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

from netns import SUBNET_PREFIX, Host, HostsUnavailable, used_third_octets

LOOPBACK = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
_serial = itertools.count()


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=False)
    if r.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {r.stderr.strip() or f'exit code {r.returncode}'}")


@dataclass
class Lan:
    hosts: list[Host]
    multicast: bool
    note: str
    netns: list[str] = field(default_factory=list)

    def leftover_pids(self) -> list[int]:
        """Processes still inside the namespaces (all of them were started by the test)."""
        pids: list[int] = []
        for ns in self.netns:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
            pids += [int(p) for p in r.stdout.split()]
        return pids

    def remove(self) -> None:
        for pid in self.leftover_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for ns in reversed(self.netns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _octet() -> int:
    used = used_third_octets()
    start = (os.getpid() + 97) % 200 + 20
    for k in itertools.chain(range(start, 255), range(1, start)):
        if k not in used:
            return k
    raise OSError(f"every {SUBNET_PREFIX}.x.0/24 is in use on this machine")


def _make(tag: str, n: int) -> Lan:
    k = _octet()
    bridge_ns = f"{tag}-br"
    short = tag.replace("-", "")[-10:]
    lan = Lan([], True, "")
    try:
        _ip("netns", "add", bridge_ns)
        lan.netns.append(bridge_ns)
        _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge_ns, "link", "set", "br0", "up")
        for i in range(n):
            letter = "abcdefgh"[i]
            ns, addr = f"{tag}-{letter}", f"{SUBNET_PREFIX}.{k}.{i + 1}"
            _ip("netns", "add", ns)
            lan.netns.append(ns)
            inner, outer = f"{short}{letter}h", f"{short}{letter}b"
            _ip("link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", bridge_ns)
            _ip("-n", bridge_ns, "link", "set", outer, "master", "br0")
            _ip("-n", bridge_ns, "link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            lan.hosts.append(Host(ns, addr, ns))
    except BaseException:
        lan.remove()
        raise
    names = ", ".join(f"{h.netns} ({h.address})" for h in lan.hosts)
    lan.note = f"{n} network namespaces on one bridge: {names}"
    return lan


def _loopback_works() -> bool:
    for addr in LOOPBACK:
        with socket.socket() as s:
            try:
                s.bind((addr, 0))
            except OSError:
                return False
    return True


@contextlib.contextmanager
def lan_hosts(n: int = 3) -> Iterator[Lan]:
    """`n` (≤ 3 on the fallback) hosts on one LAN, named `cpd-<pid>-<k>-a`, `-b`, …; removed at the
    end, also after a failure. Raises HostsUnavailable when neither kind can be had."""
    tag = f"cpd-{os.getpid()}-{next(_serial)}"
    why = ""
    lan: Lan | None = None
    if os.environ.get("CPOOL_TEST_NETNS", "1") == "0":
        why = "CPOOL_TEST_NETNS=0"
    elif os.geteuid() != 0:
        why = "not root"
    elif shutil.which("ip") is None:
        why = "no `ip` (iproute2)"
    else:
        try:
            lan = _make(tag, n)
        except OSError as e:
            why = str(e)
    if lan is None:
        if n > len(LOOPBACK) or not _loopback_works():
            raise HostsUnavailable(f"no network namespaces ({why}) and no loopback {LOOPBACK[:n]}")
        hosts = [Host(f"{tag}-{'abc'[i]}", LOOPBACK[i], None) for i in range(n)]
        note = f"NOTE: no network namespaces ({why}); hosts share this machine's stack, unicast only"
        lan = Lan(hosts, False, note)
    try:
        yield lan
    finally:
        lan.remove()
