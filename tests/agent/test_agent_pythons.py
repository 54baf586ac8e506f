"""An agent restarted with its stored credential tells the pool again which Pythons its jobs can run:
a Python installed after the join is seen without joining anew."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_agent_loop import Server, start_agent, stop_agent, wait_for

from computepool.agent.join import tenant_pythons

LABEL = "cpool.io/python-{}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("pythons"))
    yield s
    s.close()


def _forget_pythons(db: Path, node: str) -> None:
    """The node's record as an agent left it before python3.X was installed: no version, no label."""
    with sqlite3.connect(db) as conn:
        (labels,) = conn.execute("SELECT labels FROM nodes WHERE name = ?", (node,)).fetchone()
        kept = {k: v for k, v in json.loads(labels).items() if not k.startswith(LABEL.format(""))}
        conn.execute("UPDATE nodes SET pythons = '[]', labels = ? WHERE name = ?", (json.dumps(kept), node))


def test_a_restarted_agent_reports_its_pythons_again(server: Server, tmp_path: Path) -> None:
    here = tenant_pythons()
    if not here:
        pytest.skip("no python3.X a tenant can run on this machine")
    data = tmp_path / "agent"
    agent = start_agent(server, data, "--simulate", "1xT4-16GB", "--name", "py-1", token=server.join_token())
    try:
        wait_for("the node ready", lambda: (n := server.node("py-1")) and n["state"] == "ready")
        want = 0o711 if os.geteuid() == 0 else 0o700  # the executor is up: the agent is fully started
        wait_for("the data dir's mode", lambda: stat.S_IMODE(data.stat().st_mode) == want)
    finally:
        rc, out = stop_agent(agent)
    assert rc == 0, out
    _forget_pythons(server.root / "srv" / "pool.db", "py-1")
    node = server.node("py-1")
    assert node is not None and node["pythons"] == [], node
    assert not any(k.startswith(LABEL.format("")) for k in node["labels"]), node["labels"]

    agent = start_agent(server, data)  # the stored credential: no join, so only a heartbeat can say it
    try:
        node = wait_for("the pythons re-reported", lambda: (n := server.node("py-1")) and n["pythons"] and n)
    finally:
        rc, out = stop_agent(agent)
    assert rc == 0, out
    assert "joined the pool" not in out
    assert node["pythons"] == here
    assert {k: v for k, v in node["labels"].items() if k.startswith(LABEL.format(""))} == {
        LABEL.format(v): "yes" for v in here
    }
