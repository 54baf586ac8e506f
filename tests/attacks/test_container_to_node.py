"""B's container dials listeners on the node's own addresses.

A container given ports runs on its tenant's own network, whose bridge address is the node's;
what the node listens on every address (or on its LAN address, routed to it from the bridge)
took the container's connections: tenant A's notebook on a job on the node's network, a system
user's database. The host firewall held tenants' sockets on the node (their uids) from those, but
a container's packets come in from the bridge, with no uid. Its input chain now refuses the
containers of tenants' networks the same listeners; root's services (the control plane) stay open.
This runs the firewall in a network namespace of the test's own (nothing of the host is touched).
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

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="nftables, namespaces and tenant uids need root"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="nftables (nft) not installed"),
]

PROBE = Path(__file__).with_name("flow_probe.py")


def test_a_container_reaches_no_listener_of_another_tenant_or_a_system_user_on_the_node() -> None:
    lo = random.randrange(64000, 64800, 100)
    done = subprocess.run(
        ["unshare", "--net", sys.executable, str(PROBE), str(lo), "reach"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {
        "A's": "refused",
        "A's at the LAN address": "refused",
        "A's on the LAN address alone": "refused",
        "system": "refused",
        "root": "reached",
    }, got
