"""Two hosts on one machine, for the multi-host gang tests: two network namespaces joined by a veth
pair, a control plane and an agent in the first, a second agent in the second.

Each namespace is a host of its own: its own address on a private /24 that nothing on this machine
uses, its own loopback, and its own /etc/hosts (`ip netns exec` binds /etc/netns/NAME/hosts over it)
in which the machine's name resolves to that host's address, as it does on a real host. Where
namespaces cannot be made (not root, no CAP_NET_ADMIN, no `ip`), both hosts fall back to loopback
addresses 127.0.0.2 and 127.0.0.3 of this machine's one network stack, and `note` says so
(CPOOL_TEST_NETNS=0 asks for that fallback).

The test process itself stays in its own namespace; it reaches the control plane through an httpx
transport that opens its connections from inside the first namespace (setns(2) on the calling
thread, undone right after), and runs the CLI with `ip netns exec`.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from e2e_helpers import Pool, child_env, cpool, free_port, stop, wait_for

from computepool.core.tls import generate_self_signed

CLONE_NEWNET = 0x40000000
SUBNET_PREFIX = "10.231"
LOOPBACK_ADDRESSES = ("127.0.0.2", "127.0.0.3")
ETC_NETNS = Path("/etc/netns")  # where `ip netns exec NS` finds the files it binds over /etc for NS
_serial = itertools.count()


class HostsUnavailable(OSError):
    """Neither network namespaces nor the loopback fallback can be had on this machine."""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=False)
    if r.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {r.stderr.strip() or f'exit code {r.returncode}'}")


@contextlib.contextmanager
def entered(netns: str) -> Iterator[None]:
    """The calling thread inside network namespace `netns` for the block: sockets made there stay
    there. Only this thread moves, and it moves back even when the block fails."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
        finally:
            os.close(target)
        try:
            yield
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns back home: {os.strerror(err)}")
    finally:
        os.close(home)


class NetnsTransport(httpx.HTTPTransport):
    """Connections opened from inside a network namespace (responses are read from those sockets
    wherever the caller is)."""

    def __init__(self, netns: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.netns = netns

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with entered(self.netns):
            return super().handle_request(request)


class NetnsPool(Pool):
    """e2e_helpers.Pool whose connections are opened from inside a network namespace."""

    def __init__(self, url: str, data_dir: Path, ca: Path, netns: str) -> None:
        super().__init__(url, data_dir, ca)
        headers = dict(self.http.headers)
        self.http.close()
        self.http = httpx.Client(
            base_url=url, headers=headers, timeout=10, transport=NetnsTransport(netns, verify=self.verify)
        )

    def ready(self) -> bool:
        return self.http.get("/readyz", timeout=2).status_code == 200


@dataclass(frozen=True)
class Host:
    """One of the two hosts: node name, the address peers reach it at, its namespace (None on the
    loopback fallback)."""

    name: str
    address: str
    netns: str | None

    def argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else list(argv)


def used_third_octets() -> set[int]:
    """Third octets of 10.231.x.0/24 this machine uses (its addresses and routes), so that the pair's
    subnet never shadows one of them (the namespaces' own stacks are theirs alone)."""
    texts = []
    for cmd in (["ip", "-br", "addr"], ["ip", "route"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
        texts.append(r.stdout)
    pattern = re.compile(rf"\b{re.escape(SUBNET_PREFIX)}\.(\d+)\.")
    return {int(m) for m in pattern.findall("\n".join(texts))}


def _free_octet() -> int:
    used = used_third_octets()
    start = os.getpid() % 200 + 20
    for k in itertools.chain(range(start, 255), range(1, start)):
        if k not in used:
            return k
    raise OSError(f"every {SUBNET_PREFIX}.x.0/24 is in use on this machine")


@dataclass
class TwoHosts:
    """The pair of hosts and what to undo at the end."""

    a: Host
    b: Host
    note: str
    netns: list[str] = field(default_factory=list)
    etc_dirs: list[Path] = field(default_factory=list)

    def leftover_pids(self) -> list[int]:
        """Processes still inside the namespaces (all of them were started by this test)."""
        pids: list[int] = []
        for ns in self.netns:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
            pids += [int(p) for p in r.stdout.split()]
        return pids

    def remove(self) -> None:
        for pid in self.leftover_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for ns in self.netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        for d in self.etc_dirs:
            shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            ETC_NETNS.rmdir()  # only when empty: other namespaces' files stay


def _make_namespaces(tag: str) -> TwoHosts:
    k = _free_octet()
    ns_a, ns_b = f"{tag}-a", f"{tag}-b"
    veth_a, veth_b = f"{tag.replace('-', '')[:13]}a", f"{tag.replace('-', '')[:13]}b"
    addr_a, addr_b = f"{SUBNET_PREFIX}.{k}.1", f"{SUBNET_PREFIX}.{k}.2"
    hosts = TwoHosts(
        Host(f"{tag}-a", addr_a, ns_a),
        Host(f"{tag}-b", addr_b, ns_b),
        f"two network namespaces {ns_a} ({addr_a}) and {ns_b} ({addr_b}) joined by a veth pair",
    )
    try:
        for ns in (ns_a, ns_b):
            _ip("netns", "add", ns)
            hosts.netns.append(ns)
        _ip("link", "add", veth_a, "netns", ns_a, "type", "veth", "peer", "name", veth_b, "netns", ns_b)
        hostname = socket.gethostname()
        for ns, dev, addr in ((ns_a, veth_a, addr_a), (ns_b, veth_b, addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            etc = ETC_NETNS / ns
            etc.mkdir(parents=True, exist_ok=True)
            hosts.etc_dirs.append(etc)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{addr} {hostname}\n")
            os.chmod(etc / "hosts", 0o644)
    except BaseException:
        hosts.remove()
        raise
    return hosts


def _loopback_works() -> bool:
    for addr in LOOPBACK_ADDRESSES:
        with socket.socket() as s:
            try:
                s.bind((addr, 0))
            except OSError:
                return False
    return True


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """Two hosts, unique to this run (`cpt-<pid>-<n>-a`/`-b`); removed at the end, also after a failure.

    Raises HostsUnavailable when neither namespaces nor the loopback fallback can be had.
    """
    tag = f"cpt-{os.getpid()}-{next(_serial)}"
    why = ""
    hosts: TwoHosts | None = None
    if os.environ.get("CPOOL_TEST_NETNS", "1") == "0":
        why = "CPOOL_TEST_NETNS=0"
    elif os.geteuid() != 0:
        why = "not root"
    elif shutil.which("ip") is None:
        why = "no `ip` (iproute2)"
    else:
        try:
            hosts = _make_namespaces(tag)
        except OSError as e:
            why = str(e)
    if hosts is None:
        if not _loopback_works():
            raise HostsUnavailable(f"no network namespaces ({why}) and no loopback {LOOPBACK_ADDRESSES}")
        a, b = LOOPBACK_ADDRESSES
        note = f"NOTE: no network namespaces ({why}); both hosts share this machine's stack as {a} and {b}"
        hosts = TwoHosts(Host(f"{tag}-a", a, None), Host(f"{tag}-b", b, None), note)
    try:
        yield hosts
    finally:
        hosts.remove()


class Cluster:
    """`cpool server` (HTTPS, its certificate made for host A's address) and agent A on host A, agent
    B on host B; each agent with its own data dir, node name and `--address`."""

    def __init__(self, hosts: TwoHosts, root: Path) -> None:
        self.hosts, self.root = hosts, root
        self.port = 8470 if hosts.a.netns else free_port()
        self.url = f"https://{hosts.a.address}:{self.port}"
        self.srv_dir = root / "srv"
        self.cert, self.key = root / "tls" / "cert.pem", root / "tls" / "key.pem"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._api: Pool | None = None

    @property
    def pool(self) -> Pool:
        """The admin's API client (once started)."""
        assert self._api is not None, "the cluster is not started"
        return self._api

    def _start(self, what: str, host: Host, args: Sequence[str]) -> None:
        with (self.root / f"{what}.log").open("ab") as out:
            self.procs[what] = subprocess.Popen(
                host.argv(cpool(*args)), stdout=out, stderr=subprocess.STDOUT, env=child_env()
            )

    def agent_dir(self, host: Host) -> Path:
        return self.root / f"agent-{host.name[-1]}"

    def start(self) -> Pool:
        a, b = self.hosts.a, self.hosts.b
        generate_self_signed(self.cert, self.key, [a.address, "localhost", "127.0.0.1"])
        self._start("server", a, ["server", "--data-dir", str(self.srv_dir), "--host", a.address,
                                  "--port", str(self.port), "--tls-cert", str(self.cert),
                                  "--tls-key", str(self.key)])  # fmt: skip
        wait_for("the control plane", lambda: (self.srv_dir / "admin-token").exists(), 60, self.logs)
        pool = self._api = self._pool()
        wait_for("the control plane", pool.ready, 60, self.logs)
        r = pool.http.post("/api/v1/join-tokens", json={"single_use": False})
        assert r.status_code == 201, r.text
        token = r.json()["token"]
        for host in (a, b):
            self._start(f"agent-{host.name[-1]}", host, [
                "agent", "--server", self.url, "--join-token", token, "--ca", str(self.cert),
                "--data-dir", str(self.agent_dir(host)), "--name", host.name, "--address", host.address,
                "--kill-grace-s", "1", "--poll-wait-s", "5"])  # fmt: skip
        want = {a.name: "ready", b.name: "ready"}
        wait_for(
            "both nodes ready", lambda: {n["name"]: n["state"] for n in pool.nodes()} == want, 60, self.logs
        )
        return pool

    def _pool(self) -> Pool:
        """The admin's API client; from inside host A's namespace when there is one."""
        netns = self.hosts.a.netns
        return (
            NetnsPool(self.url, self.srv_dir, self.cert, netns)
            if netns
            else Pool(self.url, self.srv_dir, self.cert)
        )

    def cli_env(self) -> dict[str, str]:
        env = child_env()
        env.update(
            CPOOL_SERVER=self.url,
            CPOOL_CA=str(self.cert),
            CPOOL_TOKEN=(self.srv_dir / "admin-token").read_text().strip(),
        )
        return env

    def cli(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        """`cpool ARGS` as a user on host A runs it."""
        argv = self.hosts.a.argv(cpool(*args))
        return subprocess.run(argv, env=self.cli_env(), capture_output=True, text=True, timeout=timeout)

    def cli_popen(self, *args: str, out: Path) -> subprocess.Popen[bytes]:
        with out.open("wb") as f:
            return subprocess.Popen(
                self.hosts.a.argv(cpool(*args)), env=self.cli_env(), stdout=f, stderr=subprocess.STDOUT
            )

    def logs(self) -> str:
        parts = []
        for f in sorted(self.root.glob("*.log")):
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-6000:]}")
        return "\n".join(parts)

    def job_processes(self, alloc_id: int, rank: int, exe: str) -> list[psutil.Process]:
        """The processes running `exe` for member `rank` of allocation `alloc_id` (by their env)."""
        found = []
        for p in psutil.process_iter():
            try:
                if p.cmdline()[:1] != [exe]:
                    continue
                env = p.environ()
            except psutil.Error:
                continue
            if env.get("CPOOL_ALLOCATION_ID") == str(alloc_id) and env.get("NODE_RANK") == str(rank):
                found.append(p)
        return found

    def close(self) -> None:
        if self._api is not None:
            self._api.close()
        for what in ("agent-b", "agent-a", "server"):
            if what in self.procs:
                stop(self.procs[what])
