"""`cpool bench coop`'s own pool: a server and two root agents on loopback with discovery (unicast
only: mDNS on a shared machine would also hear every other pool's agents), one impostor announcing
itself with a key from another secret, and the tear-down of all of it.

Each process runs in a session of its own, so a Ctrl-C reaches the bench alone, which then stops
things in order: services and their allocations first (agents leave running jobs behind, as they
should in a real pool), then the agents, the impostor and the server, what still runs from the
bench's directory, the tenant's Unix user, and the directory.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from computepool.client.bench_pool import free_port
from computepool.client.errors import PoolError, ServerUnreachable
from computepool.client.http import ENDED_STATES, PoolClient
from computepool.discovery.runner import Discovery, DiscoveryConfig

HOST = "127.0.0.1"
JOIN_TIMEOUT_S = 90.0
PEERS_TIMEOUT_S = 120.0
Say = Callable[[str], None]


class BenchError(RuntimeError):
    """The bench's own pool did not come up, or a service did not serve: one line for the user."""


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ)
        for k in ("CPOOL_JOIN_TOKEN", "CPOOL_DATA_DIR", "CPOOL_AGENT_DIR", "CPOOL_SERVER", "CPOOL_TOKEN"):
            env.pop(k, None)
        with self.log.open("ab") as out:
            # a session of its own: a Ctrl-C reaches the bench alone, which then stops things in order
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True,
            )  # fmt: skip

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 1) -> str:
        try:
            text = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return " | ".join(text[-lines:])

    def stop(self, grace_s: float = 20.0) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _cpool(*args: str) -> list[str]:
    return [sys.executable, "-m", "computepool.cli.main", *args]


@dataclass
class BenchPool:
    root: Path
    server: Proc
    url: str = ""
    agents: list[Proc] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    disc_ports: list[int] = field(default_factory=list)
    impostor_port: int = 0
    tenant: str = ""
    agents_ready_at: float = 0.0


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, procs: list[Proc]) -> Any:
    """Poll `check` until it returns something truthy; fail early when one of `procs` exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError, PoolError, ServerUnreachable, OSError):
            got = check()
            if got:
                return got
        for p in procs:
            if p.exited() is not None:
                raise BenchError(f"{p.name} exited ({p.exited()}) while waiting for {what}: {p.tail()}")
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(0.3)


def _start_server(pool: BenchPool) -> PoolClient:
    pool.server.start()
    port = int(pool.server.argv[pool.server.argv.index("--port") + 1])
    pool.url = f"http://{HOST}:{port}"
    token_file = pool.root / "server" / "admin-token"
    wait_for(
        "the bench's server",
        lambda: httpx.get(f"{pool.url}/readyz", timeout=2).status_code == 200 and token_file.exists(),
        60,
        [pool.server],
    )
    return PoolClient(pool.url, token_file.read_text().strip(), timeout=60)


def _impostor(key_secret: bytes, targets: tuple[str, ...]) -> Discovery:
    """A node of no pool: announces itself to both agents, signed with a key from another secret."""
    from computepool.discovery.announce import DeviceSummary, derive_key

    config = DiscoveryConfig(
        key=derive_key(key_secret), node_id="impostor", address=HOST, port=0,
        devices=(DeviceSummary(0, "cpu", "cpu", 4096),), peers=targets, mdns=False,
        announce_every_s=1.0,
    )  # fmt: skip
    return Discovery(config)


def _start_agents(pool: BenchPool, admin: PoolClient, say: Say) -> None:
    suffix = secrets.token_hex(2)
    pool.names = [f"coop-{suffix}-a", f"coop-{suffix}-b"]
    for i, name in enumerate(pool.names):
        other = pool.disc_ports[1 - i]
        join = str(admin.create_join_token(600, single_use=True)["token"])
        argv = _cpool(
            "agent", "--server", pool.url, "--join-token", join, "--name", name,
            "--data-dir", str(pool.root / f"agent-{i}"), "--address", HOST, "--kill-grace-s", "2",
            "--discovery", "--no-discovery-mdns", "--discovery-address", HOST,
            "--discovery-port", str(pool.disc_ports[i]),
            "--peer", f"{HOST}:{other}", "--peer", f"{HOST}:{pool.impostor_port}",
        )  # fmt: skip
        agent = Proc(f"agent {name}", argv, pool.root / f"agent-{i}.log")
        agent.start()
        pool.agents.append(agent)
    say(f"waiting for agents {', '.join(pool.names)} to join …")

    def joined() -> bool:
        ready = {n["name"] for n in admin.list_nodes() if n.get("state") == "ready"}
        return set(pool.names) <= ready

    wait_for("both agents to join", joined, JOIN_TIMEOUT_S, [pool.server, *pool.agents])
    pool.agents_ready_at = time.monotonic()


def peer_report(pool: BenchPool, admin: PoolClient, say: Say) -> dict[str, Any]:
    """Until each agent has reported the other as verified and someone the impostor as rejected."""
    say("waiting for the agents to find each other (and to reject the impostor) …")
    a, b = pool.names
    seen_at: dict[str, float] = {}

    def found() -> list[dict[str, Any]] | None:
        rows = admin.list_peers()
        now = time.monotonic() - pool.agents_ready_at
        for observer, other in ((a, b), (b, a)):
            if observer not in seen_at and any(
                r["observer"] == observer and r["node_id"] == other and r["status"] == "ok" for r in rows
            ):
                seen_at[observer] = round(now, 2)
        rejected = any(r["status"] == "rejected" for r in rows)
        return rows if len(seen_at) == 2 and rejected else None

    rows: list[dict[str, Any]] = wait_for("the agents' peer reports", found, PEERS_TIMEOUT_S, pool.agents)
    ok = sorted({str(r["peer_key"]) for r in rows if r["status"] == "ok"})
    rejected = {str(r["peer_key"]): str(r["reason"]) for r in rows if r["status"] == "rejected"}
    links = [
        {"observer": r["observer"], "peer": r["peer_key"], "rtt_ms": r["rtt_ms"],
         "bandwidth_mbps": r["bandwidth_mbps"]}
        for r in rows if r["status"] == "ok"
    ]  # fmt: skip
    return {
        "peers_found": len(ok),
        "peers_rejected": len(rejected),
        "found": ok,
        "rejected": rejected,
        "links": links,
        "seen_after_s": seen_at,
    }


def settle(admin: PoolClient, tenant: str | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(PoolError, ServerUnreachable):
        while time.monotonic() < deadline:
            live = [
                a for a in admin.list_allocations(limit=10_000)
                if a["state"] not in ENDED_STATES and (tenant is None or a["tenant"] == tenant)
            ]  # fmt: skip
            if not live:
                return
            if time.monotonic() > deadline - timeout_s / 2:  # not gone by themselves: cancel
                for a in live:
                    with contextlib.suppress(PoolError):
                        admin.cancel_allocation(a["id"])
            time.sleep(0.5)


def _kill_under(root: Path) -> int:
    """SIGKILL what still runs from `root` (job supervisors and sandbox inits name their run dir):
    agents leave their jobs running when they stop, as they should in a real pool."""
    mine, killed = str(root), 0
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.pid != os.getpid() and any(mine in arg for arg in proc.info["cmdline"] or ()):
                proc.kill()
                killed += 1
    return killed


@contextlib.contextmanager
def bench_pool(
    say: Say, forget_tenant: Callable[[str], object] = lambda _: None
) -> Iterator[tuple[BenchPool, PoolClient]]:
    """The bench's own pool; `forget_tenant` removes the tenant's Unix user at the end (the CLI
    passes the agent's own function: the client layer does not reach into the agent's)."""
    # not under /tmp nor /var/tmp: a job has its own, and the engines' jobs read the model from here
    root = Path("/var/cache") / f"cpool-bench-coop-{secrets.token_hex(4)}"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    server = Proc(
        "the bench's server",
        _cpool("server", "--data-dir", str(root / "server"), "--host", HOST, "--port", str(free_port()),
               "--service-ports", _service_ports(), "--rpc-ports", _service_ports(),
               "--publish-ports", "30000-30999"),  # apart from the ranges above (none publishes)
        root / "server.log",
    )  # fmt: skip
    pool = BenchPool(root, server)
    impostor: Discovery | None = None
    admin: PoolClient | None = None
    try:
        say("starting a server, two agents with discovery and one impostor on loopback …")
        admin = _start_server(pool)
        pool.disc_ports = [free_port(), free_port()]
        impostor = _impostor(secrets.token_bytes(32), tuple(f"{HOST}:{p}" for p in pool.disc_ports))
        impostor.start()
        pool.impostor_port = int(impostor.port)
        _start_agents(pool, admin, say)
        yield pool, admin
    finally:
        if admin is not None:
            with contextlib.suppress(PoolError, ServerUnreachable):
                for svc in admin.services():
                    with contextlib.suppress(PoolError):
                        admin.delete_service(str(svc["name"]), tenant=str(svc["tenant"]))
            settle(admin, None, 20.0)
            admin.close()
        for agent in pool.agents:
            agent.stop()
        if impostor is not None:
            impostor.stop()
        server.stop()
        _kill_under(root)
        if pool.tenant:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                forget_tenant(pool.tenant)
        shutil.rmtree(root, ignore_errors=True)


def _service_ports() -> str:
    base = 20000 + 100 * secrets.randbelow(100)  # below the ephemeral range; apart from other pools
    return f"{base}-{base + 99}"
