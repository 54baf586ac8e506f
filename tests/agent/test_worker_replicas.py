"""A function's worker reaches every replica its agent knows: the agent hands it the URLs it was
given and those it learnt since (CPOOL_SERVER, comma-separated), and the worker moves to the next
one when a replica refuses the connection or answers 503."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from computepool.agent.api import AgentApi
from computepool.agent.executor import Executor
from computepool.agent.jobstart import JobStarter
from computepool.sdk import worker


def test_a_worker_is_given_the_replicas_the_agent_learnt(executor: Executor, tmp_path: Path) -> None:
    api = AgentApi("http://127.0.0.1:8470")
    api.learn({"servers": ["http://127.0.0.1:8470", "http://127.0.0.1:8471"]})  # a heartbeat's answer
    starter = JobStarter("n", None, executor, tmp_path, None, server="http://127.0.0.1:8470")  # type: ignore[arg-type]
    starter.replicas = api.servers  # as the agent wires it
    env = starter.worker_env({"CPOOL_WORKER_TOKEN": "t"}, tmp_path)
    assert env["CPOOL_SERVER"] == "http://127.0.0.1:8470,http://127.0.0.1:8471"
    assert starter.worker_env({}, tmp_path) == {}  # not a worker: nothing added
    api.close()


class _Replica(BaseHTTPRequestHandler):
    status = 200
    seen: list[tuple[str, str, dict[str, object]]]

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.path, self.headers["Authorization"], body))
        out = json.dumps({"ok": True} if self.status == 200 else {"error": "database unavailable"}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def replicas() -> Iterator[tuple[list[str], list[tuple[str, str, dict[str, object]]]]]:
    """A dead URL, a replica answering 503 and one that answers: their URLs, and what reached them."""
    seen: list[tuple[str, str, dict[str, object]]] = []
    servers = []
    for status in (503, 200):
        handler = type("Replica", (_Replica,), {"status": status, "seen": seen})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    with socket.socket() as s:  # a port nobody listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    urls = [f"http://127.0.0.1:{dead}"] + [f"http://127.0.0.1:{srv.server_address[1]}" for srv in servers]
    yield urls, seen
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_the_worker_moves_on_to_a_replica_that_answers(
    replicas: tuple[list[str], list[tuple[str, str, dict[str, object]]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    urls, seen = replicas
    monkeypatch.setenv("CPOOL_SERVER", ",".join(urls))
    monkeypatch.setenv("CPOOL_WORKER_TOKEN", "tok")
    monkeypatch.delenv("CPOOL_CA", raising=False)
    api = worker.Api()
    assert api.post("/worker/next", {"n": 1}) == {"ok": True}
    assert [p for p, _, _ in seen] == ["/api/v1/worker/next"] * 2  # the 503 one, then the live one
    assert all(auth == "Bearer tok" and body == {"n": 1} for _, auth, body in seen)
    assert api.post("/worker/next", {"n": 2}) == {"ok": True}  # it stays with the one that answers
    assert len(seen) == 3
    api.close()
