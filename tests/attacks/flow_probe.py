"""Run as root inside a network namespace of its own (`unshare --net`), under a root agent's host
firewall (hostwall.py): tenants' process jobs with a network of their own (jobnet's real launcher
and slirp4netns), or a container behind a bridge of a tenant network (`container` mode), sending
UDP to many ports with a cap of 300 flows; or that container dialling listeners on the node's
addresses (`reach` mode).

Prints one JSON object: how many entries of this namespace's connection table each made, or what
the container reached.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading

from computepool.agent import jobnet
from computepool.agent.hostwall import HostWall

LO = int(sys.argv[1])  # tenants' uids: LO (tenant A) and LO + 1 (tenant B)
A, B = LO, LO + 1
PY = "/usr/bin/python3"  # a tenant's uid may not reach the test's own interpreter
NODE = "10.77.0.1"  # the node's LAN address
FAR = "10.99.0.5"  # a host beyond the LAN's router (which drops what it is sent here)
ECHO_PORT = 39999  # root's service on the node (reachable through slirp4netns): the job's pacing
# The job: one UDP socket to N ports of a far host; every 50 datagrams a round trip to root's echo
# on another socket, which slirp4netns relays in order: all sent before have passed slirp4netns.
FLOOD = """
import socket, sys
far, first, count, node, echo = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sync = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sync.settimeout(1)
for i in range(count):
    s.sendto(b"x", (far, first + i))
    while i % 50 == 49 or i == count - 1:
        sync.sendto(b"sync", (node, echo))
        try:
            if sync.recvfrom(100)[0] == b"sync":
                break
        except TimeoutError:
            pass  # lost on a busy host: ask again
print("done", flush=True)
"""


def tracked(first: int, count: int, to: str = FAR) -> int:
    """Entries of this namespace's connection table to `to` on ports first … first + count - 1."""
    ports = {f"dport={p}" for p in range(first, first + count)}
    with open("/proc/net/nf_conntrack") as f:
        return sum(1 for line in f if f"dst={to} " in line and ports & set(line.split()))


def echo(server: socket.socket) -> None:
    while True:
        data, peer = server.recvfrom(100)
        server.sendto(data, peer)


def job(uid: int, first: int, count: int) -> str:
    """A process job of `uid` with a network of its own, as the agent launches one."""
    slirp = shutil.which("slirp4netns")
    opts = jobnet.options(slirp, True, False, uid)  # slirp4netns in the tenant's group, as sandbox.wrap
    argv = [
        *jobnet.launcher_argv(opts),
        "unshare", "--pid", "--fork", "--",  # root, as the job's own: slirp4netns ends with it
        "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
        PY, "-c", FLOOD, FAR, str(first), str(count), NODE, str(ECHO_PORT),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    return done.stdout.strip() or done.stderr.strip()[-300:]


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True)


def lan() -> None:
    """The node's LAN (eth7, NODE) and a router on it to FAR that drops what it is sent."""
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "link", "add", "eth7", "type", "veth", "peer", "name", "eth7p")
    sh("ip", "addr", "add", f"{NODE}/24", "dev", "eth7")
    for dev in ("eth7", "eth7p"):
        sh("ip", "link", "set", dev, "up")
    sh("ip", "neigh", "add", "10.77.0.2", "lladdr", "02:00:00:00:77:02", "dev", "eth7")
    sh("ip", "route", "add", "10.99.0.0/16", "via", "10.77.0.2")


def main() -> None:
    lan()
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind((NODE, ECHO_PORT))
    threading.Thread(target=echo, args=(server,), daemon=True).start()
    wall = HostWall("0123abcd", (LO, LO + 9), flows=300)
    assert wall.install() == ""
    out: dict[str, object] = {}
    out["B job"] = job(B, 40000, 1000)
    out["B"] = tracked(40000, 1000)
    out["A job"] = job(A, 42000, 100)
    out["A"] = tracked(42000, 100)
    wall.close()
    print(json.dumps(out))


GATEWAY = "10.88.7.1"  # the node's address on the tenant network's bridge
BOX = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
print("up", flush=True)
for to in sys.argv[1:]:
    sys.stdin.readline()
    for port in range(40000, 41000):
        try:
            s.sendto(b"x", (to, port))
        except OSError:
            pass  # refused: the next
    print("sent", flush=True)
"""


def boxed(code: str, *args: str) -> subprocess.Popen[str]:
    """A container (`code` in a network namespace of its own, once it has printed "up") at
    10.88.7.2 behind the bridge "podman7" of a tenant network, the node being GATEWAY there."""
    box = subprocess.Popen(
        ["unshare", "--net", PY, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert box.stdout is not None and box.stdout.readline().strip() == "up"
    sh("ip", "link", "add", "podman7", "type", "veth", "peer", "name", "ctr0")
    sh("ip", "link", "set", "ctr0", "netns", str(box.pid))
    sh("ip", "addr", "add", f"{GATEWAY}/24", "dev", "podman7")
    sh("ip", "link", "set", "podman7", "up")
    inside = ["nsenter", "-t", str(box.pid), "-n", "ip"]
    sh(*inside, "addr", "add", "10.88.7.2/24", "dev", "ctr0")
    sh(*inside, "link", "set", "ctr0", "up")
    sh(*inside, "route", "add", "default", "via", GATEWAY)
    return box


def container() -> None:
    """A container of a tenant network sends UDP to 1,000 ports of the node's address on its bridge
    (delivered to the node: the input path) and of a far host (forwarded)."""
    lan()
    sh("sysctl", "-q", "-w", "net.ipv4.ip_forward=1")  # this namespace's alone
    box = boxed(BOX, GATEWAY, FAR)
    try:
        assert box.stdin is not None and box.stdout is not None
        wall = HostWall("0123abcd", (LO, LO + 9), flows=300)
        assert wall.install() == ""
        wall.add_container_subnets(["10.88.7.0/24"])  # as container_net.py does for a tenant network
        out = {}
        for to in (GATEWAY, FAR):
            box.stdin.write("\n")
            box.stdin.flush()
            assert box.stdout.readline().strip() == "sent"
            out[to] = tracked(40000, 1000, to)
        wall.close()
    finally:
        box.kill()
    print(json.dumps({"to the node": out[GATEWAY], "forwarded": out[FAR]}))


LISTEN = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("up", flush=True)
while True:
    c = s.accept()[0]
    c.sendall(b"SECRET")
    c.close()
"""
DIAL = """
import json, socket, sys
print("up", flush=True)
sys.stdin.readline()
out = {}
for name, host, port in json.loads(sys.argv[1]):
    try:
        with socket.create_connection((host, port), timeout=3) as c:
            out[name] = "reached" if c.recv(10) == b"SECRET" else "closed"
    except OSError as e:
        out[name] = "refused" if e.errno in (13, 113) else f"error {e.errno}"
print(json.dumps(out), flush=True)
"""


def reach() -> None:
    """A container of tenant B's network dials listeners on the node's addresses (its bridge's and
    the LAN's): tenant A's on every address and on the LAN address, a system user's, root's."""
    lan()
    procs: list[subprocess.Popen[str]] = []
    for uid, host, port in ((A, "0.0.0.0", 7040), (LO + 50, "0.0.0.0", 7041), (A, NODE, 7043)):
        who = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        argv = [*who, PY, "-c", LISTEN, host, str(port)]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
        assert procs[-1].stdout is not None and procs[-1].stdout.readline().strip() == "up"
    procs.append(subprocess.Popen([PY, "-c", LISTEN, "0.0.0.0", "7042"], stdout=subprocess.PIPE, text=True))
    assert procs[-1].stdout is not None and procs[-1].stdout.readline().strip() == "up"  # root's
    targets = [
        ("A's", GATEWAY, 7040),
        ("A's at the LAN address", NODE, 7040),
        ("A's on the LAN address alone", NODE, 7043),
        ("system", GATEWAY, 7041),
        ("root", GATEWAY, 7042),
    ]
    box = boxed(DIAL, json.dumps(targets))
    procs.append(box)
    try:
        assert box.stdin is not None and box.stdout is not None
        wall = HostWall("0123abcd", (LO, LO + 9))
        assert wall.install() == ""
        wall.add_container_subnets(["10.88.7.0/24"])
        box.stdin.write("\n")
        box.stdin.flush()
        print(box.stdout.readline().strip())
        wall.close()
    finally:
        for p in procs:
            p.kill()


if __name__ == "__main__":
    {"container": container, "reach": reach}.get(sys.argv[2] if sys.argv[2:] else "", main)()
