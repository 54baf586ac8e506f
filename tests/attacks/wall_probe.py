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
s = socket.create_server((sys.argv[1], int(sys.argv[2])), family=family)
print("up", flush=True)
time.sleep(600)
"""
PY = "/usr/bin/python3"  # a tenant's uid may not reach the test's own interpreter


LISTENERS: list[subprocess.Popen[str]] = []


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True)


def as_uid(uid: int, *argv: str) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]


def listen(uid: int, host: str, port: int) -> subprocess.Popen[str]:
    argv = as_uid(uid, PY, "-c", LISTEN, host, str(port))
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    LISTENERS.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "up", p.communicate()[1]
    return p


def dial(uid: int, targets: list[tuple[str, str, int]]) -> dict[str, str]:
    argv = [PY, "-c", DIAL, json.dumps(targets)]
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


if __name__ == "__main__":
    try:
        aliased() if sys.argv[2:] == ["aliased"] else main()
    finally:
        for p in LISTENERS:
            p.kill()
