"""Jobs on the node's network against the node's loopback services and the metadata address.

Service replicas, gang members and the function workers of a control plane on the node's
loopback keep the node's network. Before the host firewall (agent/hostwall.py), such a job of any
tenant reached a system user's database listening on 127.0.0.1, another tenant's notebook there,
and the cloud's metadata address. These run the firewall in a network namespace of the test's
own (its nftables tables are that namespace's: nothing of the host is touched), with processes
of tenant uids, and through a real root agent.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from computepool.agent.identity import agent_id

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="nftables and tenant uids need root"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="nftables (nft) not installed"),
]

PROBE = Path(__file__).with_name("wall_probe.py")


def test_tenants_on_the_nodes_network_reach_neither_system_services_nor_others_listeners() -> None:
    lo = random.randrange(64000, 64800, 100)  # uids no other test's tenants use
    done = subprocess.run(
        ["unshare", "--net", sys.executable, str(PROBE), str(lo)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    everything = {k: "reached" for k in got["before"]}
    assert got["before"] == everything  # without the table every tenant reaches all of it
    assert got["install"] == "" and not got["stale left"]
    assert got["A"] == {
        "metadata": "refused",
        "root": "reached",  # root's own services (a control plane) authenticate
        "root protected": "refused",
        "system": "refused",
        "system v6": "refused",
        "tenant A's": "reached",  # its own listener
        "dns": "reached",
    }
    assert got["B"] == {**got["A"], "tenant A's": "refused"}  # another tenant's listener
    assert got["root"] == everything  # the pool and the node's own users are not held
    assert got["later"] == {"new system": "refused", "control plane": "reached"}
    assert not got["table left"] and got["after"] == {"system": "reached"}


def test_a_listener_on_the_same_port_elsewhere_on_loopback_opens_nothing_of_another_tenants() -> None:
    lo = random.randrange(64000, 64800, 100)
    done = subprocess.run(
        ["unshare", "--net", sys.executable, str(PROBE), str(lo), "aliased"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["B"] == {
        "A v4": "refused",
        "A v6": "refused",
        "B v4": "reached",
        "B v4 on A's v6 port": "reached",
    }
    assert got["A"] == {
        "A v4": "reached",
        "A v6": "reached",
        "B v4": "refused",
        "B v4 on A's v6 port": "refused",
    }


# A function's worker of a control plane on the node's loopback keeps the node's network.
DIAL = r"""
import json, os, socket, sys, urllib.request
out = {"healthz": urllib.request.urlopen(os.environ["CPOOL_SERVER"] + "/healthz", timeout=10).status}
s = socket.socket()
s.settimeout(5)
try:
    s.connect(("127.0.0.1", int(sys.argv[1])))
    out["system service"] = s.recv(64).decode()
except OSError as e:
    out["system service"] = f"refused: {e.strerror}"
print(json.dumps(out), flush=True)
"""
NOBODY = 65534  # a system user's service: a database listening on the node's loopback alone
LISTEN = (
    "import socket, time\ns = socket.create_server(('127.0.0.1', 0))\nprint(s.getsockname()[1], flush=True)\n"
)
LISTEN += "while True:\n    c = s.accept()[0]\n    c.sendall(b'DB-SECRET')\n    c.close()\n"


def test_the_nodes_other_addresses_slirp_and_foreign_bridges_are_held_too() -> None:
    """Through the node's LAN address a job on the node reached a database listening on every
    address (or on that one); slirp4netns (root, for any tenant's job) reached those and other
    tenants' listeners; a `[::]` listener taking IPv6 alone cut its port's owner off over IPv4;
    and a container on a bridge another agent made was reached at its own address."""
    lo = random.randrange(64000, 64800, 100)
    done = subprocess.run(
        ["unshare", "--net", sys.executable, str(PROBE), str(lo), "lan"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(got["before"].values()) == {"reached"}
    assert set(got["before slirp"].values()) == {"reached"}
    assert got["A"] == {
        "system": "refused",
        "system on the LAN address": "refused",
        "A's": "reached",
        "root": "reached",
        "A's v4 beside B's v6-only": "reached",  # B's socket takes IPv6 alone: the port is A's
        "container": "refused",
        "published": "reached",  # a published port is the container's front door
    }
    assert got["B"] == {**got["A"], "A's": "refused", "A's v4 beside B's v6-only": "refused"}
    assert got["root"] == got["before"]
    assert got["slirp"] == {
        **got["B"],
        "A's v4 beside B's v6-only": "refused",  # for whichever tenant: every tenant's listener
        "system on loopback": "refused",
    }


def test_a_connection_made_before_the_table_knew_the_listener_breaks_at_the_next_refresh() -> None:
    """Who listens is read every 2 s: B dialled A's new listener in that moment and kept the
    connection for as long as it liked. Every packet B's socket sends is checked now, not the
    first alone, so the connection ends at the next refresh; A's own goes on."""
    lo = random.randrange(64000, 64800, 100)
    done = subprocess.run(
        ["unshare", "--net", sys.executable, str(PROBE), str(lo), "window"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert (got["A before"], got["B before"], got["A after"]) == ("echoed", "echoed", "echoed")
    assert got["B after"].startswith("error"), got  # refused, or left unanswered until it gives up


def test_a_tenant_cannot_fill_the_nodes_connection_table() -> None:
    """One UDP socket sending to 10,000 ports made 10,000 entries of the node's one connection
    table in under a second; full, it drops every new connection of the node. Each tenant user has
    its share now (300 here): past it its new flows are refused, another tenant's are not."""
    lo = random.randrange(64000, 64800, 100)
    done = subprocess.run(
        ["unshare", "--net", sys.executable, str(PROBE), str(lo), "flows"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert (got["A"], got["B"], got["root"]) == (300, 300, 1000), got
    assert got["tracked"] <= 1600, got


def test_a_root_agents_worker_on_the_nodes_network_does_not_reach_a_system_users_service() -> None:
    from e2e_helpers import JOB_PYTHON, wait_for
    from job_node import job_node

    service = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", JOB_PYTHON, "-c", LISTEN],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert service.stdout is not None
        port = int(service.stdout.readline())
        with job_node() as node:
            table = f"cpool_{agent_id(node.agent_dir)}_{node.agent.pid}"

            def installed() -> bool:
                out = subprocess.run(["nft", "list", "tables", "inet"], capture_output=True, text=True)
                return table in out.stdout

            wait_for("the agent's firewall table", installed, 30, node.logs)
            _, b = node.member("fw")
            request = {"command": [JOB_PYTHON, "-c", DIAL, str(port)], "cpu_milli": 100}
            r = b.post("/api/v1/functions", json={"name": "dial", "request": request})
            assert r.status_code == 201, r.text
            calls = b.post(f"/api/v1/functions/{r.json()['id']}/calls", json={"calls": [{"args": "eA=="}]})
            assert calls.status_code == 200, calls.text

            def said() -> dict[str, object] | None:
                for item in b.get("/api/v1/allocations").json()["items"]:
                    out = str(b.get(f"/api/v1/allocations/{item['id']}/logs").json()["stdout"]["data"])
                    if out.startswith("{"):
                        return dict(json.loads(out.splitlines()[-1]))
                return None

            got = wait_for("the worker's dial", said, 90, node.logs)
            assert got == {"healthz": 200, "system service": "refused: No route to host"}, got
    finally:
        service.kill()
        service.wait()
