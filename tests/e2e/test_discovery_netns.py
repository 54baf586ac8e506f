"""LAN discovery end to end: a control plane and two agents (`cpool agent --discovery`) on hosts of
their own (network namespaces on one bridge, discovery_hosts.py), plus two impostors on a third
host — a forger that claims the pool's public fingerprint but signs with a key of its own, and a
node of another pool. The agents find each other over mDNS, measure their link and report; `cpool
peers --json` lists both verified with RTT and bandwidth and the impostors rejected with the reason.
A third agent started with `--no-discovery-mdns --peer` finds the first over unicast only.

Where namespaces cannot be made, the hosts are loopback addresses and every agent uses unicast
(`--peer`): multicast does not travel there, but authentication and reporting are tested alike.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from discovery_hosts import Lan, lan_hosts
from e2e_helpers import Pool, child_env, cpool, free_port, stop, wait_for
from netns import Host, HostsUnavailable, NetnsPool

from computepool.discovery.announce import derive_key, fingerprint

TIMEOUT_S = 120.0  # two cores shared by many tests: discovery is seconds, but give it room

IMPOSTORS = r"""
import signal, sys, threading
from dataclasses import replace
from computepool.discovery.announce import DeviceSummary, derive_key
from computepool.discovery.runner import Discovery, DiscoveryConfig

address, pool_fp, mdns, forger_port, stranger_port, *peers = sys.argv[1:]

class Forger(Discovery):
    # Copies the pool's public fingerprint (every announcement carries it); cannot sign with its key.
    def announcement(self):
        return replace(super().announcement(), pool=pool_fp).signed(self.config.key)

def config(name, secret, port):
    return DiscoveryConfig(key=derive_key(secret), node_id=name, address=address, port=int(port),
                           devices=(DeviceSummary(0, "cpu", "cpu", 1024),), peers=tuple(peers),
                           mdns=mdns == "1", announce_every_s=1.0)

parts = [Forger(config("forger", b"a forger's own secret, 32 bytes!", forger_port)),
         Discovery(config("stranger", b"another pool's secret, 32 bytes!", stranger_port))]
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: done.set())
for p in parts:
    p.start()
print("impostors ready", flush=True)
done.wait()
for p in parts:
    p.stop()
"""


class DiscoveryLan:
    """`cpool server` and agent A on host a, agent B on host b, the impostors on host c."""

    def __init__(self, lan: Lan, root: Path) -> None:
        self.lan, self.root = lan, root
        self.a, self.b, self.c = lan.hosts
        self.server_port = 8470 if self.a.netns else free_port()
        self.url = f"http://{self.a.address}:{self.server_port}"
        self.srv_dir = root / "srv"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # one port number on each namespace; distinct ones where the hosts share one stack
        fixed = self.a.netns is not None
        self.ports = {k: (5757 if fixed else free_port()) for k in ("a", "b", "c")}
        self.forger_port = 5758 if fixed else free_port()
        self.stranger_port = 5759 if fixed else free_port()

    def _start(self, what: str, host: Host, argv: list[str]) -> None:
        with (self.root / f"{what}.log").open("ab") as out:
            self.procs[what] = subprocess.Popen(
                host.argv(argv), stdout=out, stderr=subprocess.STDOUT, env=child_env()
            )

    def start(self) -> None:
        argv = ["server", "--data-dir", str(self.srv_dir), "--host", self.a.address,
                "--port", str(self.server_port), "--log-level", "warning"]  # fmt: skip
        self._start("server", self.a, cpool(*argv))
        wait_for("the control plane", lambda: (self.srv_dir / "admin-token").exists(), 60, self.logs)
        self.api = (
            NetnsPool(self.url, self.srv_dir, None, self.a.netns)  # type: ignore[arg-type]  # plain http: no CA
            if self.a.netns
            else Pool(self.url, self.srv_dir)
        )
        wait_for("the control plane", self.api.ready, 60, self.logs)
        r = self.api.http.post("/api/v1/join-tokens", json={"single_use": False})
        assert r.status_code == 201, r.text
        self.join_token = r.json()["token"]
        mdns = self.lan.multicast
        self.agent("a", self.a, [] if mdns else ["--peer", f"{self.b.address}:{self.ports['b']}"])
        # B names neither its address nor a discovery address where it can: the route to the server
        self.agent("b", self.b, [] if mdns else ["--peer", f"{self.a.address}:{self.ports['a']}"],
                   address=not mdns)  # fmt: skip
        pool_fp = wait_for("the discovery key", self.pool_fingerprint, 60, self.logs)
        peers = [] if mdns else [f"{h.address}:{self.ports[k]}" for k, h in (("a", self.a), ("b", self.b))]
        self._start("impostors", self.c, [sys.executable, "-c",
                    IMPOSTORS, self.c.address, pool_fp, "1" if mdns else "0", str(self.forger_port),
                    str(self.stranger_port), *peers])  # fmt: skip
        wait_for("the impostors", lambda: "impostors ready" in self.log("impostors"), 60, self.logs)

    def agent(
        self, key: str, host: Host, extra: list[str], *, address: bool = True, mdns: bool = True
    ) -> None:
        argv = ["agent", "--server", self.url, "--join-token", self.join_token, "--name", host.name,
                "--data-dir", str(self.root / f"agent-{key}"), "--kill-grace-s", "1", "--poll-wait-s", "5",
                "--discovery", "--discovery-port", str(self.ports[key])]  # fmt: skip
        if address:
            argv += ["--address", host.address]
        if not (self.lan.multicast and mdns):
            argv += ["--no-discovery-mdns", "--discovery-address", host.address]
        self._start(f"agent-{key}", host, cpool(*argv, *extra))
        wait_for(f"agent {key} to join", lambda: self.node_ready(host.name), 60, self.logs)

    def node_ready(self, name: str) -> bool:
        return any(n["name"] == name and n["state"] == "ready" for n in self.api.nodes())

    def rows(self) -> list[dict[str, Any]]:
        """GET /peers: one row per observer × peer."""
        return list(self.api.http.get("/api/v1/peers").json()["items"])

    def key(self) -> bytes:
        return derive_key(bytes.fromhex((self.srv_dir / "discovery-key").read_text().strip()))

    def pool_fingerprint(self) -> str | None:
        """Known once an agent fetched the key (the server makes it on the first request)."""
        return fingerprint(self.key()) if (self.srv_dir / "discovery-key").exists() else None

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """`cpool ARGS` as the admin on host a."""
        env = child_env()
        env.update(CPOOL_SERVER=self.url, CPOOL_TOKEN=(self.srv_dir / "admin-token").read_text().strip())
        return subprocess.run(
            self.a.argv(cpool(*args)), env=env, capture_output=True, text=True, timeout=timeout
        )

    def peers(self, *args: str) -> dict[str, dict[str, Any]]:
        r = self.cli("peers", "--json", *args)
        assert r.returncode == 0, r.stderr
        return {p["peer"]: p for p in json.loads(r.stdout)["items"]}

    def log(self, what: str) -> str:
        f = self.root / f"{what}.log"
        return f.read_text(errors="replace") if f.exists() else ""

    def logs(self) -> str:
        return "\n".join(
            f"--- {f.name}\n{f.read_text(errors='replace')[-5000:]}" for f in sorted(self.root.glob("*.log"))
        )

    def close(self) -> None:
        if hasattr(self, "api"):
            self.api.close()
        for what in ("impostors", "agent-c", "agent-b", "agent-a", "server"):
            if what in self.procs:
                stop(self.procs[what])


@pytest.fixture(scope="module")
def dlan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DiscoveryLan]:
    root = tmp_path_factory.mktemp("discovery")
    with contextlib.ExitStack() as stack:
        try:
            lan = stack.enter_context(lan_hosts(3))
        except HostsUnavailable as e:
            pytest.skip(f"three hosts cannot be made on this machine: {e}")
        if lan.multicast:
            print(f"\n{lan.note}")
        else:  # said in the run's summary, not only when a test fails
            warnings.warn(lan.note, stacklevel=1)
        d = DiscoveryLan(lan, root)
        try:
            d.start()
            yield d
        finally:
            d.close()
        left = lan.leftover_pids()
        assert not left, f"processes left in the namespaces after the pool stopped: {left}"


def _row(rows: list[dict[str, Any]], observer: str, **match: Any) -> dict[str, Any] | None:
    for r in rows:
        if r["observer"] == observer and all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def test_agents_find_each_other_and_reject_the_impostors(dlan: DiscoveryLan) -> None:
    a, b = dlan.a.name, dlan.b.name
    source = "mdns" if dlan.lan.multicast else "unicast"

    def settled() -> bool:
        rows = dlan.rows()
        for observer, other in ((a, b), (b, a)):
            ok = _row(rows, observer, peer_key=other, status="ok")
            if ok is None or ok["rtt_ms"] is None or ok["bandwidth_mbps"] is None:
                return False
            for impostor in ("forger", "stranger"):
                if _row(rows, observer, node_id=impostor, status="rejected") is None:
                    return False
        return True

    wait_for("both agents verified and measured, both impostors rejected", settled, TIMEOUT_S, dlan.logs)

    items = dlan.peers()
    for name, other in ((a, b), (b, a)):
        p = items[name]
        assert p["rejected"] is None and p["node_id"] == name, p
        assert p["address"] == (dlan.a if name == a else dlan.b).address, p
        assert any(d["kind"] == "cpu" and d["memory_mib"] > 0 for d in p["devices"]), p
        [seen] = [s for s in p["seen_by"] if s["observer"] == other]
        assert seen["status"] == "ok" and seen["source"] == source, seen
        assert seen["rtt_ms"] > 0 and seen["bandwidth_mbps"] > 0, seen
    by_claim = {p["node_id"]: p for p in items.values() if p["rejected"]}
    forged, foreign = by_claim["forger"]["rejected"], by_claim["stranger"]["rejected"]
    assert forged == "bad signature: not signed with this pool's discovery key", forged
    assert foreign.startswith("bad signature") and "another pool" in foreign, foreign
    for impostor in ("forger", "stranger"):
        p = by_claim[impostor]
        assert p["peer"].startswith(dlan.c.address + ":") and p["devices"] == [], p
        assert {s["observer"] for s in p["seen_by"]} >= {a, b}, p
    assert not any(r["status"] == "ok" and r["node_id"] in ("forger", "stranger") for r in dlan.rows())

    table = dlan.cli("peers")
    assert table.returncode == 0, table.stderr
    for text in (a, b, "bad signature", "another pool", "Mb/s"):
        assert text in table.stdout, table.stdout

    # the key is a secret: no agent logs it (nor the server's secret it is derived from)
    secret = (dlan.srv_dir / "discovery-key").read_text().strip()
    for what in ("agent-a", "agent-b", "server"):
        log = dlan.log(what)
        assert dlan.key().hex() not in log and secret not in log, what


def test_an_agent_with_unicast_only_finds_its_peer(dlan: DiscoveryLan) -> None:
    a, c = dlan.a.name, dlan.c.name
    dlan.agent("c", dlan.c, ["--peer", f"{dlan.a.address}:{dlan.ports['a']}"], mdns=False)

    def found() -> bool:
        rows = dlan.rows()
        there = _row(rows, c, peer_key=a, status="ok", source="unicast")
        back = _row(rows, a, peer_key=c, status="ok", source="unicast")
        return there is not None and back is not None and there["rtt_ms"] is not None

    wait_for("the unicast-only agent and its peer to find each other", found, TIMEOUT_S, dlan.logs)
    if dlan.lan.multicast:  # it announced nothing over mDNS: B, which it never named, never heard of it
        assert _row(dlan.rows(), dlan.b.name, peer_key=c) is None
    items = dlan.peers("--observer", c)
    assert items[a]["rejected"] is None and [s["source"] for s in items[a]["seen_by"]] == ["unicast"]
