"""A real one-node pool for the attacks on a node: `cpool server` (with the test's flags) and a root
`cpool agent` on loopback, data dirs under /var/tmp (a job has a /tmp of its own), tenants with
member tokens whose users are removed at the end, and the agent's containers removed with it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from e2e_helpers import child_env, cpool, free_port, kill_jobs_under, stop, wait_for

from computepool.agent.container import Podman
from computepool.agent.identity import agent_id
from computepool.agent.tenants import remove_tenant_user

ENDED = ("released", "failed", "cancelled", "preempted", "lost")


class Node:
    def __init__(
        self,
        root: Path,
        server_args: tuple[str, ...],
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        agent_args: tuple[str, ...] = (),
    ) -> None:
        self.root = root
        self.server_args = (*server_args, "--host", host)
        self.agent_args = agent_args
        self.env = child_env() | (env or {})  # the server's and the agent's (and `cpool` commands')
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.srv_dir, self.agent_dir = root / "srv", root / "agent"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tenants: list[str] = []
        self.tokens: dict[str, str] = {}

    def start(self) -> None:
        env = self.env
        with (self.root / "server.log").open("ab") as out:
            self.server = subprocess.Popen(
                cpool("server", "--data-dir", str(self.srv_dir), "--port", str(self.port), *self.server_args),
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        self.procs.append(self.server)
        wait_for("the server", lambda: httpx.get(f"{self.url}/readyz").is_success, 60, self.logs)
        self.token = (self.srv_dir / "admin-token").read_text().strip()
        headers = {"Authorization": f"Bearer {self.token}"}
        self.admin = httpx.Client(base_url=self.url, headers=headers, timeout=30)
        join = self.admin.post("/api/v1/join-tokens", json={}).json()["token"]
        with (self.root / "agent.log").open("ab") as out:
            self.agent = subprocess.Popen(
                cpool("agent", "--server", self.url, "--join-token", join, "--data-dir", str(self.agent_dir),
                      "--name", f"n{uuid.uuid4().hex[:6]}", "--kill-grace-s", "1", *self.agent_args),
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        self.procs.append(self.agent)
        wait_for("the node", lambda: self.states() == ["ready"], 60, self.logs)

    def add_agent(self) -> None:
        """A second root agent on this machine (a gang of two nodes: its members keep the node's
        network), with a data dir and name of its own."""
        join = self.admin.post("/api/v1/join-tokens", json={}).json()["token"]
        name = f"n{uuid.uuid4().hex[:6]}"
        with (self.root / "agent2.log").open("ab") as out:
            self.procs.append(
                subprocess.Popen(
                    cpool(
                        "agent",
                        "--server",
                        self.url,
                        "--join-token",
                        join,
                        "--data-dir",
                        str(self.root / "agent2"),
                        "--name",
                        name,
                        "--kill-grace-s",
                        "1",
                    ),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                )  # fmt: skip
            )
        wait_for("the second node", lambda: self.states() == ["ready", "ready"], 60, self.logs)

    def states(self) -> list[str]:
        return [n["state"] for n in self.admin.get("/api/v1/nodes").json()["items"]]

    def logs(self) -> str:
        return "\n".join(
            (self.root / f).read_text()[-4000:]
            for f in ("server.log", "agent.log", "agent2.log")
            if (self.root / f).exists()
        )

    def member(self, prefix: str) -> tuple[str, httpx.Client]:
        """A new tenant (named `prefix` + a unique part) and a client holding its member's token."""
        tenant = f"{prefix}{uuid.uuid4().hex[:6]}"
        r = self.admin.post("/api/v1/tenants", json={"name": tenant})
        assert r.status_code == 201, r.text
        self.tenants.append(tenant)
        user = f"m-{tenant}"
        r = self.admin.post("/api/v1/users", json={"name": user, "tenant": tenant, "role": "member"})
        assert r.status_code == 201, r.text
        r = self.admin.post("/api/v1/tokens", json={"user": user})
        assert r.status_code == 201, r.text
        self.tokens[tenant] = r.json()["token"]
        client = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.tokens[tenant]}"}, timeout=30
        )
        return tenant, client

    def cli_env(self, tenant: str) -> dict[str, str]:
        """The environment a `cpool` command of `tenant`'s member runs in."""
        return {**self.env, "CPOOL_SERVER": self.url, "CPOOL_TOKEN": self.tokens[tenant]}

    def submit(self, client: httpx.Client, command: list[str], **kw: Any) -> int:
        r = client.post("/api/v1/allocations", json={"command": command, "cpu_milli": 100, **kw})
        assert r.status_code == 201, r.text
        return int(r.json()["id"])

    def ended(self, client: httpx.Client, alloc_id: int, timeout: float = 120) -> dict[str, Any]:
        """The allocation once it has ended (an agent reports the end after the job's output)."""

        def done() -> dict[str, Any] | None:
            r = client.get(f"/api/v1/allocations/{alloc_id}")
            return dict(r.json()) if r.status_code == 200 and r.json()["state"] in ENDED else None

        return dict(wait_for(f"allocation {alloc_id} to end", done, timeout, self.logs))

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)
        kill_jobs_under(self.root)
        self._drop_firewalls()
        if shutil.which("podman"):
            for agent_dir in (d for d in (self.agent_dir, self.root / "agent2") if d.exists()):
                podman = Podman(agent_dir)
                for key in podman.all_keys():
                    podman.remove(key)
        for tenant in self.tenants:
            remove_tenant_user(tenant)

    def _drop_firewalls(self) -> None:
        """The host firewall tables the agents kept for jobs left running (none run now)."""
        if shutil.which("nft") is None:
            return
        ids = {agent_id(d) for d in (self.agent_dir, self.root / "agent2")}
        listed = subprocess.run(["nft", "list", "tables", "inet"], capture_output=True, text=True).stdout
        for line in listed.splitlines():
            name = line.removeprefix("table inet ").strip()
            if any(name.startswith(f"cpool_{i}_") for i in ids):
                subprocess.run(["nft", "delete", "table", "inet", name], capture_output=True, check=False)


@contextmanager
def job_node(
    *server_args: str,
    env: dict[str, str] | None = None,
    host: str = "127.0.0.1",
    agent_args: tuple[str, ...] = (),
) -> Iterator[Node]:
    """The pool; `host`: the address its server listens on and its agent calls; `agent_args`: more
    flags of its agent's."""
    root = Path("/var/tmp") / f"cpool-jl-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o755)
    node = Node(root, server_args, env, host, agent_args)
    try:
        node.start()
        yield node
    finally:
        node.close()
        shutil.rmtree(root, ignore_errors=True)


def secret_listener(listener: socket.socket, secret: bytes) -> list[int]:
    """Answer `secret` to whoever connects to `listener` (until it is closed), in a thread; one
    entry per connection in the list returned, so a test can say that nobody came."""
    accepted: list[int] = []

    def serve() -> None:
        while True:
            try:
                c = listener.accept()[0]
            except OSError:
                return
            accepted.append(1)
            c.sendall(secret)
            c.close()

    threading.Thread(target=serve, daemon=True).start()
    return accepted
