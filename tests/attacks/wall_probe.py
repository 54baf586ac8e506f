"""Run as root inside a network namespace of its own (`unshare --net`): the host firewall of a root
agent against tenants' sockets, with real nftables and real processes of tenant uids.

Prints one JSON object: what each uid reached before and after the table, and the table's life.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from computepool.agent.hostwall import HostWall
from computepool.agent.jobnet import SLIRP_GID

LO = int(sys.argv[1])  # tenants' uids: LO (tenant A) and LO + 1 (tenant B); LO + 50 a system user
A, B, SYSTEM = LO, LO + 1, LO + 50
DIAL = """
import json, socket, sys
out = {}
for name, host, port in json.loads(sys.argv[1]):
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.settimeout(3)
    try:
        s.connect((host, port))
        out[name] = "reached"
    except OSError as e:
        out[name] = "refused" if e.errno in (13, 113) else f"error {e.errno}"  # not 111: none listens
    s.close()
print(json.dumps(out))
"""
LISTEN = """
import socket, sys, time
family = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
s = socket.socket(family)
if sys.argv[3:] == ["v6only"]:
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("up", flush=True)
time.sleep(600)
"""
PY = "/usr/bin/python3"  # a tenant's uid may not reach the test's own interpreter


LISTENERS: list[subprocess.Popen[str]] = []


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True)


def as_uid(uid: int, *argv: str) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]


def listen(uid: int, host: str, port: int, *flags: str) -> subprocess.Popen[str]:
    argv = as_uid(uid, PY, "-c", LISTEN, host, str(port), *flags)
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    LISTENERS.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "up", p.communicate()[1]
    return p


def dial(uid: int, targets: list[tuple[str, str, int]], gid: int | None = None) -> dict[str, str]:
    argv = [PY, "-c", DIAL, json.dumps(targets)]
    if gid is not None:  # root in another group: slirp4netns's
        argv = ["setpriv", f"--regid={gid}", "--clear-groups", *argv]
    out = subprocess.run(as_uid(uid, *argv) if uid else argv, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout))


def main() -> None:
    sh("ip", "link", "set", "lo", "up")
    sh("sysctl", "-q", "-w", "net.ipv4.ip_unprivileged_port_start=0")  # this namespace's alone: port 53
    sh("ip", "addr", "add", "169.254.169.254/32", "dev", "lo")  # the metadata address, answered here
    metadata = socket.create_server(("169.254.169.254", 80))
    root_svc = socket.create_server(("127.0.0.1", 7001))  # root's own service (a control plane)
    root_protected = socket.create_server(("127.0.0.1", 7002))  # root's, named in --protect-ports
    listen(SYSTEM, "127.0.0.1", 7003)  # a system user's database on loopback
    listen(SYSTEM, "::", 7004)  # the same on the wildcard (reaches ::1 and 127.0.0.1)
    listen(A, "127.0.0.1", 7005)  # tenant A's own notebook on loopback
    listen(SYSTEM, "127.0.0.1", 53)  # a resolver: DNS stays open
    targets = [
        ("metadata", "169.254.169.254", 80),
        ("root", "127.0.0.1", 7001),
        ("root protected", "127.0.0.1", 7002),
        ("system", "127.0.0.1", 7003),
        ("system v6", "::1", 7004),
        ("tenant A's", "127.0.0.1", 7005),
        ("dns", "127.0.0.1", 53),
    ]
    out: dict[str, object] = {"before": dial(B, targets)}
    stale = "cpool_deadbeef_4999999"  # a killed agent's table (no such pid)
    sh("nft", "add", "table", "inet", stale)
    wall = HostWall("0123abcd", (LO, LO + 9), lambda: {7009}, [7002])
    out["install"] = wall.install()
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    out["stale left"] = stale in tables
    out["A"], out["B"], out["root"] = dial(A, targets), dial(B, targets), dial(0, targets)
    listen(SYSTEM, "127.0.0.1", 7006)  # a service started after the table
    wall.refresh()
    listen(SYSTEM, "127.0.0.1", 7009)  # on the control plane's port: exempt
    wall.refresh()
    out["later"] = dial(A, [("new system", "127.0.0.1", 7006), ("control plane", "127.0.0.1", 7009)])
    wall.close()
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    out["table left"] = wall.table in tables
    out["after"] = dial(B, [("system", "127.0.0.1", 7003)])
    for s in (metadata, root_svc, root_protected):
        s.close()
    print(json.dumps(out))


def aliased() -> None:
    """B listens on A's ports at other loopback addresses (127.0.0.2, the other family), which
    made each port B's own to the table, then dials A's listeners there."""
    sh("ip", "link", "set", "lo", "up")
    wall = HostWall("0123abcd", (LO, LO + 9))
    assert wall.install() == ""
    listen(A, "127.0.0.1", 7010)  # A's notebook on 127.0.0.1
    listen(A, "::1", 7011)  # and one on ::1
    listen(B, "127.0.0.2", 7010)  # B's own on the same ports elsewhere on loopback
    listen(B, "127.0.0.1", 7011)
    wall.refresh()
    targets = [("A v4", "127.0.0.1", 7010), ("A v6", "::1", 7011)]
    own = [("B v4", "127.0.0.2", 7010), ("B v4 on A's v6 port", "127.0.0.1", 7011)]
    print(json.dumps({"A": dial(A, targets + own), "B": dial(B, targets + own)}))
    wall.close()


CONTAINER = """
import socket, time
s = socket.create_server(("0.0.0.0", 7030))
print("up", flush=True)
time.sleep(600)
"""


ECHO = """
import socket, sys, threading
s = socket.create_server(("127.0.0.1", int(sys.argv[1])))
print("up", flush=True)
def serve(c):
    while data := c.recv(100):
        c.sendall(data)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""
HOLD = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
print("connected", flush=True)
for line in sys.stdin:
    try:
        s.sendall(b"ping")
        print("echoed" if s.recv(100) == b"ping" else "closed", flush=True)
    except OSError as e:
        print(f"error {e.errno}", flush=True)
"""


def window() -> None:
    """B connects to A's new listener before the table knows it (the refresh comes every 2 s), and
    keeps the connection: it worked on for as long as B held it."""
    sh("ip", "link", "set", "lo", "up")
    wall = HostWall("0123abcd", (LO, LO + 9))
    assert wall.install() == ""
    echo = subprocess.Popen(as_uid(A, PY, "-c", ECHO, "7050"), stdout=subprocess.PIPE, text=True)
    LISTENERS.append(echo)
    assert echo.stdout is not None and echo.stdout.readline().strip() == "up"
    out = {}
    for who, uid in (("A", A), ("B", B)):
        hold = subprocess.Popen(
            as_uid(uid, PY, "-c", HOLD, "7050"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        LISTENERS.append(hold)
        assert hold.stdin is not None and hold.stdout is not None
        assert hold.stdout.readline().strip() == "connected"  # in the window: no one knew the port yet
        hold.stdin.write("\n")
        hold.stdin.flush()
        out[f"{who} before"] = hold.stdout.readline().strip()
        LISTENERS.append(hold)
        out[who] = hold  # type: ignore[assignment]
    wall.refresh()  # the table learns A's listener
    for who in ("A", "B"):
        hold = out.pop(who)  # type: ignore[assignment]
        hold.stdin.write("\n")
        hold.stdin.flush()
        out[f"{who} after"] = hold.stdout.readline().strip()
    print(json.dumps(out))
    wall.close()


FLOOD = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sent = 0
for port in range(40000, 41000):
    try:
        s.sendto(b"x", ("127.0.0.1", port))
        sent += 1
    except OSError:
        pass
print(sent)
"""


def flows() -> None:
    """A tenant's UDP socket sending to 1,000 ports: each a flow in the node's one connection table."""
    sh("ip", "link", "set", "lo", "up")
    wall = HostWall("0123abcd", (LO, LO + 9), flows=300)
    assert wall.install() == ""
    out = {}
    for who, uid in (("A", A), ("B", B), ("root", 0)):
        argv = [PY, "-c", FLOOD]
        done = subprocess.run(as_uid(uid, *argv) if uid else argv, capture_output=True, text=True, check=True)
        out[who] = int(done.stdout)
    with open("/proc/sys/net/netfilter/nf_conntrack_count") as f:
        out["tracked"] = int(f.read())
    wall.close()
    print(json.dumps(out))


def lan() -> None:
    """The node's other addresses, slirp4netns's connections, a `[::]` listener that takes IPv6
    alone, and a container behind a podman bridge no agent of this table made."""
    sh("ip", "link", "set", "lo", "up")
    sh("ip", "link", "add", "eth7", "type", "veth", "peer", "name", "eth7p")  # the node's LAN
    sh("ip", "addr", "add", "10.77.0.1/24", "dev", "eth7")
    sh("ip", "link", "set", "eth7", "up")
    box = subprocess.Popen(["unshare", "--net", PY, "-c", CONTAINER], stdout=subprocess.PIPE, text=True)
    LISTENERS.append(box)  # a container in a namespace of its own, behind the bridge "podman7"
    assert box.stdout is not None and box.stdout.readline().strip() == "up"
    sh("ip", "link", "add", "podman7", "type", "veth", "peer", "name", "ctr0")
    sh("ip", "link", "set", "ctr0", "netns", str(box.pid))
    sh("ip", "addr", "add", "10.88.7.1/24", "dev", "podman7")
    sh("ip", "link", "set", "podman7", "up")
    inside = ["nsenter", "-t", str(box.pid), "-n", "ip"]
    sh(*inside, "addr", "add", "10.88.7.2/24", "dev", "ctr0")
    sh(*inside, "link", "set", "ctr0", "up")
    sh(*inside, "link", "set", "lo", "up")
    sh(*inside, "route", "add", "default", "via", "10.88.7.1")  # answers to the node's other address
    nat = "table ip probe_nat {\n chain out {\n  type nat hook output priority -100; policy accept;\n"
    nat += "  ip daddr 10.77.0.1 tcp dport 7031 dnat to 10.88.7.2:7030\n }\n}\n"
    subprocess.run(["nft", "-f", "-"], input=nat, text=True, check=True)  # the container's published port
    listen(SYSTEM, "0.0.0.0", 7020)  # a database on every address of the node
    listen(SYSTEM, "10.77.0.1", 7021)  # one on the LAN address alone
    listen(A, "0.0.0.0", 7022)  # tenant A's notebook on every address
    root_svc = socket.create_server(("0.0.0.0", 7023))  # root's (a control plane)
    listen(A, "0.0.0.0", 7024)  # A's own on IPv4 ...
    listen(B, "::", 7024, "v6only")  # ... and B's on the same port, IPv6 alone
    lan = [
        ("system", "10.77.0.1", 7020),
        ("system on the LAN address", "10.77.0.1", 7021),
        ("A's", "10.77.0.1", 7022),
        ("root", "10.77.0.1", 7023),
        ("A's v4 beside B's v6-only", "127.0.0.1", 7024),
        ("container", "10.88.7.2", 7030),
        ("published", "10.77.0.1", 7031),
    ]
    slirp = [*lan, ("system on loopback", "127.0.0.1", 7020)]
    out: dict[str, object] = {"before": dial(B, lan), "before slirp": dial(0, slirp, SLIRP_GID)}
    wall = HostWall("0123abcd", (LO, LO + 9))
    assert wall.install() == ""
    out["A"], out["B"], out["root"] = dial(A, lan), dial(B, lan), dial(0, lan)
    out["slirp"] = dial(0, slirp, SLIRP_GID)
    wall.close()
    root_svc.close()
    print(json.dumps(out))


if __name__ == "__main__":
    try:
        mode = sys.argv[2:3]
        modes = {"lan": lan, "aliased": aliased, "window": window, "flows": flows}
        modes.get(mode[0] if mode else "", main)()
    finally:
        for p in LISTENERS:
            p.kill()
