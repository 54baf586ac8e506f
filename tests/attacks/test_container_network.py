"""Containers given ports: another tenant's container and the metadata address.

On podman's default network every container that published a port shared one bridge: tenant B's
container reached any port of tenant A's container at its bridge address, published or not, and
the cloud's metadata address through the node. Each tenant user now has its own isolated network
(agent/container_net.py), and the agent's host firewall refuses the metadata addresses to what
those networks forward (agent/hostwall.py).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from computepool.agent.container import Podman
from computepool.agent.executor import JobSpec
from computepool.agent.hostwall import HostWall

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="rootful podman needs root"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="nftables (nft) not installed"),
]

IMAGE = "localhost/pybase:1"
SERVE = """
import socket
s = socket.create_server(("0.0.0.0", 9999))
while True:
    c = s.accept()[0]
    c.sendall(b"A-SECRET")
    c.close()
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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _work(tmp: Path, name: str, uid: int) -> Path:
    d = tmp / name / "work"
    d.mkdir(parents=True)
    os.chown(d, uid, uid)
    return d


def test_another_tenants_container_and_the_metadata_address_are_out_of_reach(
    tmp_path: Path, image: str
) -> None:
    podman = Podman(tmp_path / "agent", node_name="test-node", publish_host="127.0.0.1")
    ua, ub = random.sample(range(64400, 64499), 2)  # two tenants' users no other test uses
    wall = HostWall(uuid.uuid4().hex[:8], (64990, 64999))  # its uid rules match nobody here
    assert wall.install() == ""
    podman.networks.on_subnets = wall.add_container_subnets
    served = None
    try:
        a = JobSpec("na", 1, ["python3", "-c", SERVE], tenant="a", image=IMAGE, ports=(_free_port(),))
        argv = podman.run_argv(a, _work(tmp_path, "a", ua), ua, ua)
        assert f"--network=computepool-uid-{ua}" in argv
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

        def dial(tenant: str, uid: int, attempt: int) -> dict[str, str]:
            targets = [["A's container", address, 9999], ["metadata", "169.254.169.254", 80]]
            spec = JobSpec(f"n{tenant}", attempt, ["python3", "-c", DIAL, json.dumps(targets)], tenant=tenant,
                           image=IMAGE, ports=(_free_port(),))  # fmt: skip
            argv = podman.run_argv(spec, _work(tmp_path, f"{tenant}{attempt}", uid), uid, uid)
            done = subprocess.run(argv, env={}, cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-2000:]
            return dict(json.loads(done.stdout.strip().splitlines()[-1]))

        own = dial("a", ua, 2)  # tenant A's second container, on A's network
        assert own["A's container"] == "A-SECRET"  # the listener answers: what follows is no accident
        other = dial("b", ub, 1)
        assert other["A's container"] != "A-SECRET", other  # another network: nothing passes
        assert other["metadata"] == "errno 113" and own["metadata"] == "errno 113", (own, other)
    finally:
        for key in podman.all_keys():
            podman.remove(key)
        if served is not None:
            served.kill()
            served.wait()
        wall.close()
        for uid in (ua, ub):
            podman._podman(["network", "rm", "-f", f"computepool-uid-{uid}"])
