"""A tenant's job fills the node's connection table through a path the cap did not count.

Each tenant user may hold 8,192 flows in the node's one connection table (hostwall.py): full, it
drops every new connection of the node, the agent's heartbeats too. slirp4netns, which carries
the outbound traffic of every job with a network of its own (the default for a process job),
connects from the node's network as root, in one group for every tenant's job, and was not
counted: B's plain job sending UDP to 1,000 ports of the node's LAN address made 1,000 entries
past a cap of 300. This runs the real launcher, slirp4netns and the firewall in a network
namespace of the test's own (nothing of the host is touched).
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
    pytest.mark.skipif(shutil.which("slirp4netns") is None, reason="slirp4netns not installed"),
]

PROBE = Path(__file__).with_name("flow_probe.py")


def test_a_job_cannot_fill_the_nodes_connection_table_through_its_slirp4netns() -> None:
    lo = random.randrange(64000, 64800, 100)
    done = subprocess.run(
        ["unshare", "--net", sys.executable, str(PROBE), str(lo)],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert (got["B job"], got["A job"]) == ("done", "done"), got
    assert got["B"] <= 310, got  # its cap (300), the pacing's own flow and a little slack
    assert got["A"] >= 100, got  # another tenant's job is not refused for B's


def test_a_container_cannot_fill_the_nodes_connection_table_through_its_bridge_address() -> None:
    """A container of a tenant network (given a port) was capped on what the node forwards for it
    alone: UDP to 1,000 ports of the node's own address on its bridge (the input path) made 1,000
    entries past a cap of 300."""
    lo = random.randrange(64000, 64800, 100)
    done = subprocess.run(
        ["unshare", "--net", sys.executable, str(PROBE), str(lo), "container"],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["to the node"] + got["forwarded"] <= 300, got  # one cap for the container, both paths
    assert got["to the node"] >= 250, got  # (a few may end between the two floods)


def test_the_agent_runs_each_jobs_slirp4netns_in_its_tenants_group(tmp_path: Path) -> None:
    """What the probe above counts on: a root agent's launcher is told the tenant's group."""
    import pwd

    from computepool.agent import sandbox

    host = sandbox.HostSupport(
        root=True, setpriv="/usr/bin/setpriv", unshare="/usr/bin/unshare", namespaces=True,
        scope_why_not="", slirp="/usr/bin/slirp4netns",
    )  # fmt: skip
    user = pwd.struct_passwd(("cpool-b", "x", 61007, 61007, "", "/", "/usr/sbin/nologin"))
    argv, _ = sandbox.wrap(["true"], user, tmp_path, host, own_network=True)
    at = argv.index("--own-network")
    assert argv[at : at + 4] == ["--own-network", "/usr/bin/slirp4netns", "--slirp-group", "61007"]
