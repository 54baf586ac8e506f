"""A job on the node's network while its agent is stopped (an upgrade, a restart).

A stopped agent leaves its jobs running (the next one adopts them), but it deleted its host
firewall (hostwall.py) on the way out: until the next agent started, B's function worker (a job
on the node's network) reached a system user's database on the node's loopback, and everything
else the table refuses (the metadata address, other tenants' listeners, containers' unpublished
ports). The table now stays while jobs run, and the next agent removes it once its own is in.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess

import pytest

from computepool.agent.identity import agent_id

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="nftables and tenant uids need root"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="nftables (nft) not installed"),
]

NOBODY = 65534  # a system user's service: a database listening on the node's loopback alone
LISTEN = (
    "import socket\ns = socket.create_server(('127.0.0.1', 0))\nprint(s.getsockname()[1], flush=True)\n"
    "while True:\n    c = s.accept()[0]\n    c.sendall(b'DB-SECRET')\n    c.close()\n"
)
# B's worker: dials the database again and again, each answer a line of its work dir's dials.txt
WORKER = r"""
import socket, sys, time
while True:
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect(("127.0.0.1", int(sys.argv[1])))
        got = s.recv(64).decode() or "reached"
    except OSError as e:
        got = "refused" if e.errno in (13, 113) else f"error {e.errno}"
    s.close()
    with open("dials.txt", "a") as f:
        f.write(got + "\n")
    time.sleep(0.2)
"""


def _tables() -> str:
    return subprocess.run(["nft", "list", "tables", "inet"], capture_output=True, text=True).stdout


def test_a_job_on_the_nodes_network_stays_held_while_its_agent_is_stopped() -> None:
    from e2e_helpers import JOB_PYTHON, wait_for
    from job_node import job_node

    service = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", JOB_PYTHON, "-c", LISTEN],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert service.stdout is not None
        port = int(service.stdout.readline())
        # uids of this pool's own: another agent on the host (its default range) holds those it knows
        first = random.randrange(63000, 63900, 100)
        with job_node(agent_args=("--uid-range", f"{first}-{first + 99}")) as node:
            table = f"cpool_{agent_id(node.agent_dir)}_{node.agent.pid}"
            wait_for("the agent's firewall table", lambda: table in _tables(), 30, node.logs)
            _, b = node.member("rw")
            request = {"command": [JOB_PYTHON, "-c", WORKER, str(port)], "cpu_milli": 100}
            r = b.post("/api/v1/functions", json={"name": "dial", "request": request})
            assert r.status_code == 201, r.text
            calls = b.post(f"/api/v1/functions/{r.json()['id']}/calls", json={"calls": [{"args": "eA=="}]})
            assert calls.status_code == 200, calls.text

            def dials() -> list[str]:
                found = list(node.agent_dir.glob("runs/*/*/work/dials.txt"))
                return found[0].read_text().split("\n")[:-1] if found else []  # whole lines only

            wait_for("the worker's first dial", dials, 90, node.logs)
            assert set(dials()) == {"refused"}, dials()
            node.agent.send_signal(signal.SIGTERM)  # the agent stops; its jobs run on
            assert node.agent.wait(timeout=60) == 0, node.logs()
            seen = len(dials())
            more = lambda: len(dials()) >= seen + 5  # noqa: E731
            wait_for("the worker's dials with the agent stopped", more, 60, node.logs)
            assert set(dials()) == {"refused"}, dials()
            assert table in _tables()  # until the next agent's own is in
    finally:
        service.kill()
        service.wait()  # (the node's end removes the table its stopped agent kept)
