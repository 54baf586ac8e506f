"""A job on the node's network against another tenant's container, at its bridge address.

Each tenant's containers given ports sit on an isolated podman network of their own
(agent/container_net.py): nothing is forwarded between two tenants' networks. But the bridges are
the node's own interfaces: a process on the node's network (a gang member, a service replica, a
function worker of a control plane on loopback) reached every port of any container there, the
unpublished ones too, as the node itself does; so did every process job with a network of its own,
through its slirp4netns (a root process on the node's network). The agent's host firewall now
refuses the tenants' uids and slirp4netns's group any connection to the container networks'
addresses; a published port, which the node translates to the container, stays as reachable as it
is from any host.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from computepool.agent.container import Podman
from computepool.agent.executor import JobSpec
from computepool.agent.hostwall import HostWall

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="rootful podman and tenant uids need root"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="nftables (nft) not installed"),
]

IMAGE = "localhost/pybase:1"
SERVE = """
import socket, sys, threading
def serve(port):
    s = socket.create_server(("0.0.0.0", port))
    while True:
        c = s.accept()[0]
        c.sendall(b"A-SECRET")
        c.close()
threading.Thread(target=serve, args=(int(sys.argv[1]),), daemon=True).start()
serve(9999)  # a port never published: A's debug console
"""
DIAL = """
import json, socket, sys
out = {}
for name, host, port in json.loads(sys.argv[1]):
    try:
        c = socket.create_connection((host, port), timeout=3)
        out[name] = c.recv(16).decode() or "connected"
    except OSError as e:
        out[name] = f"errno {e.errno}"
print(json.dumps(out))
"""
SLIRP = shutil.which("slirp4netns") or ""
# the launcher's process stays root and waits, as the job's sandbox does: slirp4netns ends with it
ROOT_PARENT = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"
PY = "/usr/bin/python3"  # a tenant's uid may not reach the test's own interpreter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dial(uid: int, targets: list[tuple[str, str, int]]) -> dict[str, str]:
    argv = [PY, "-c", DIAL, json.dumps(targets)]
    if uid:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _in_own_network(uid: int, targets: list[tuple[str, str, int]]) -> dict[str, str]:
    """As a process job with a network of its own: the launcher (root) makes it and starts
    slirp4netns, then the tenant's command dials through it."""
    argv = [
        sys.executable,
        "-m",
        "computepool.agent.jobnet",
        "--own-network",
        SLIRP,
        "--",
        PY,
        "-c",
        ROOT_PARENT,
    ]
    argv += [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        PY,
        "-c",
        DIAL,
        json.dumps(targets),
    ]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_job_on_the_nodes_network_reaches_no_unpublished_port_of_another_tenants_container(
    tmp_path: Path, image: str
) -> None:
    lo = random.randrange(64500, 64590, 10)  # tenants' users no other test uses
    ua, ub = lo, lo + 1
    podman = Podman(tmp_path / "agent", node_name="test-node", publish_host="127.0.0.1")
    wall = HostWall(uuid.uuid4().hex[:8], (lo, lo + 9))
    assert wall.install() == ""
    podman.networks.on_subnets = wall.add_container_subnets
    served = None
    try:
        published = _free_port()
        a = JobSpec(
            "ha", 1, ["python3", "-c", SERVE, str(published)], tenant="a", image=IMAGE, ports=(published,)
        )
        work = tmp_path / "a" / "work"
        work.mkdir(parents=True)
        os.chown(work, ua, ua)
        argv = podman.run_argv(a, work, ua, ua)
        served = subprocess.Popen(
            argv, env={}, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        name = podman.name(a.key)
        address = ""
        for _ in range(100):
            got = podman._podman(
                ["inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", name]
            )
            address = got.stdout.strip()
            if address:
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert address, got.stderr
        targets = [("unpublished", address, 9999), ("published", "127.0.0.1", published)]
        for _ in range(100):  # the container's listener is up: the node itself reaches it
            if _dial(0, targets[:1])["unpublished"] == "A-SECRET":
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert _dial(0, targets) == {"unpublished": "A-SECRET", "published": "A-SECRET"}
        got_b = _dial(ub, targets)
        assert got_b == {"unpublished": "errno 113", "published": "A-SECRET"}, got_b
        if SLIRP:  # a process job of B with a network of its own, through slirp4netns (root)
            got_slirp = _in_own_network(ub, targets[:1])
            assert got_slirp["unpublished"] != "A-SECRET", got_slirp
    finally:
        for key in podman.all_keys():
            podman.remove(key)
        if served is not None:
            served.kill()
            served.wait()
        wall.close()
        podman._podman(["network", "rm", "-f", f"computepool-uid-{ua}"])
