"""The service controller on the real app (SQLite and PostgreSQL): replicas started as
allocations, health-checked over HTTP against real servers on loopback, scaled on the gateways'
load reports (`gateway_load` rows, written here as a gateway writes them), drained, rolled over to
a new generation one by one, replaced when unhealthy, and requeued when their node is lost."""

from __future__ import annotations

import asyncio
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from harness import Api
from test_allocations import cycle, get, manual
from test_allocations_agent import report

from computepool.server.hub import Hub
from computepool.server.logic.service_controller import DRAIN_SETTLE_S, PassReport, ServiceController
from computepool.server.logic.service_load import Load, write_load
from computepool.server.scheduling import Controller
from computepool.store.db import db_now
from computepool.store.models import Service

S = "/api/v1/services"
H = dict[str, str]


class Health:
    """A real HTTP server on a replica's port, answering its health path with `status`."""

    def __init__(self, port: int, status: int = 200) -> None:
        self.status = status
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                self.send_response(owner.status if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Pool:
    """The app with its scheduling loop and service controller stopped: the test runs both."""

    def __init__(self, api: Api) -> None:
        self.api = api
        manual(api)
        self.ctrl: ServiceController = api.app.state.service_controller
        self.ctrl.auto = False
        self.nodes: dict[str, H] = {}
        self.dark: set[str] = set()  # nodes a test lets go silent (no heartbeat from `run`)
        self.servers: dict[int, Health] = {}

    def join(self, name: str) -> H:
        token = self.api.ok("POST", "/api/v1/join-tokens", json={})["token"]
        body = {
            "join_token": token,
            "name": name,
            "cpu_milli": 4000,
            "memory_mib": 8192,
            "address": "127.0.0.1",
        }
        cred = self.api.ok("POST", "/api/v1/nodes/join", json=body, headers={})["credential"]
        self.nodes[name] = {"Authorization": f"Bearer {cred}"}
        return self.nodes[name]

    def step(self) -> PassReport:
        self.api.app.state.controller.acquire()  # the (stopped) scheduling loop would hold the lease
        return asyncio.run(self.ctrl.run_once())

    def put(self, name: str, expect: int = 201, **spec: Any) -> dict[str, Any]:
        body = {"request": {"command": ["engine"], "cpu_milli": 1000}, **spec}
        r = self.api.put(f"{S}/{name}", json={"spec": body}, headers=self.api.admin)
        assert r.status_code == expect, r.text
        return dict(r.json())

    def show(self, name: str) -> dict[str, Any]:
        return dict(self.api.ok("GET", f"{S}/{name}"))

    def replicas(self, name: str) -> list[dict[str, Any]]:
        return list(self.show(name)["replicas"])

    def load(self, sid: int, inflight: int = 0, queued: int = 0, per: dict[int, int] | None = None) -> None:
        with self.api.app.state.db.write() as s:
            write_load(s, "gw-test:1:abcdef", {sid: Load(inflight, queued, per or {})}, {sid: 0}, db_now(s))

    def run(self, alloc_id: int, healthy: bool = True) -> int:
        """Bind it (a scheduling cycle), report it running, and serve its health path. The nodes
        beat first: on a loaded machine a test's steps can outlast a short suspect_after_s."""
        for name, headers in self.nodes.items():
            if name not in self.dark:
                self.api.ok("POST", f"/api/v1/nodes/{name}/heartbeat", headers=headers)
        cycle(self.api)
        a = get(self.api, alloc_id)
        assert a["state"] == "bound", a
        node = a["nodes"][0]
        report(
            self.api,
            node,
            self.nodes[node],
            {"allocation_id": alloc_id, "attempt": a["attempt"], "state": "running", "listener": "own"},
        )
        port = int(a["env"]["PORT"])
        if healthy and port not in self.servers:
            self.servers[port] = Health(port)
        return port

    def ready(self, name: str, count: int) -> list[dict[str, Any]]:
        """Run every pending replica until `count` are ready."""
        for _ in range(count + 3):
            for r in self.replicas(name):
                if r["state"] == "pending":
                    self.run(r["allocation_id"])
            self.step()
            reps = self.replicas(name)
            if sum(r["replica_state"] == "ready" for r in reps) >= count:
                return reps
        raise AssertionError(f"not {count} ready: {self.replicas(name)}")

    def close(self) -> None:
        for srv in self.servers.values():
            srv.close()


def quiet_range(width: int = 41) -> int:
    """The first of `width` ports below the kernel's ephemeral range (which outgoing connections
    take from) that are free now: the fake replicas listen on the ports the pool gives them."""
    for _ in range(200):
        lo = random.randrange(10000, 20000 - width)  # below the publish range (20000-28999)
        try:
            for p in range(lo, lo + width):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return lo
    raise RuntimeError("no quiet port range")


@pytest.fixture
def pool(make_api: Any) -> Iterator[Pool]:
    lo = quiet_range()
    p = Pool(make_api(service_port_min=lo, service_port_max=lo + 40))
    yield p
    p.close()


def test_a_replica_starts_as_an_allocation_and_becomes_ready(pool: Pool) -> None:
    api = pool.api
    pool.join("n1")
    svc = pool.put("chat", min_replicas=1, max_replicas=2, port_env="LISTEN", startup_grace_s=60)
    rep = pool.step()
    assert len(rep.started) == 1
    [r] = pool.replicas("chat")
    assert r["state"] == "pending" and r["replica_state"] == "starting" and r["generation"] == 1
    assert r["endpoint"] is None
    a = get(api, r["allocation_id"])
    lo = api.settings.service_port_min
    assert a["name"] == "svc-chat" and a["restartable"] is True and a["command"] == ["engine"]
    assert a["env"] == {"LISTEN": str(lo), "CPOOL_SERVICE_KEY": "(hidden)"}  # the replica's key: never shown
    assert a["tenant"] == "default" and a["owner"] == "admin"
    assert pool.step().started == []  # one is enough
    cycle(api)
    running = {"allocation_id": a["id"], "attempt": 1, "state": "running", "listener": "own"}
    report(api, "n1", pool.nodes["n1"], running)
    pool.step()  # nothing listens yet: still starting
    [r] = pool.replicas("chat")
    assert r["state"] == "active" and r["replica_state"] == "starting"
    assert r["endpoint"] == f"http://127.0.0.1:{lo}" and r["node"] == "n1"
    pool.servers[lo] = Health(lo)
    assert pool.step().ready == [a["id"]]
    out = pool.show("chat")
    assert out["ready"] == 1 and out["desired"] == 1 and out["id"] == svc["id"]
    assert out["reason"] == "1 replica: no requests in flight (min 1)"
    # a second service gets another port
    pool.put("embed", min_replicas=1)
    pool.step()
    [e] = pool.replicas("embed")
    assert get(api, e["allocation_id"])["env"] == {"PORT": str(lo + 1), "CPOOL_SERVICE_KEY": "(hidden)"}


# Scale-down delay: long beside the drain's settling (1.5 s), so that steps slowed by a busy host
# never reach the next removal early.
DELAY_S = 5


def test_scale_up_on_load_then_down_after_the_delay_by_draining(pool: Pool) -> None:
    pool.join("n1")
    svc = pool.put(
        "chat", min_replicas=1, max_replicas=3, target_inflight=4, scale_down_delay_s=DELAY_S, drain_s=60
    )
    pool.step()
    [first] = pool.ready("chat", 1)
    pool.load(svc["id"], inflight=5, queued=6, per={first["allocation_id"]: 5})
    rep = pool.step()
    assert len(rep.started) == 2  # ⌈11 / 4⌉ = 3
    out = pool.show("chat")
    assert out["desired"] == 3 and out["inflight"] == 5 and out["queued"] == 6
    assert out["reason"].startswith("3 replicas: 11 requests in flight or queued, target 4 each"), out[
        "reason"
    ]
    pool.load(svc["id"], inflight=20, queued=30)
    assert pool.step().started == [] and pool.show("chat")["desired"] == 3  # max_replicas
    reps = pool.ready("chat", 3)
    a, b, c = (r["allocation_id"] for r in reps)
    # the load falls: nothing is removed before the delay
    pool.load(svc["id"], inflight=3, per={a: 2, b: 0, c: 1})
    rep = pool.step()
    assert rep.draining == [] and rep.ended == []
    assert "one fewer in" in pool.show("chat")["reason"]
    time.sleep(DELAY_S + 0.1)
    pool.load(svc["id"], inflight=3, per={a: 2, b: 0, c: 1})
    assert pool.step().draining == [b]  # the one with the fewest requests in flight
    drained_at = time.monotonic()  # the delay counts again from here
    drained = {r["allocation_id"]: r["replica_state"] for r in pool.replicas("chat")}
    assert drained == {a: "ready", b: "draining", c: "ready"}
    # a report written before the gateways could have seen it draining proves nothing
    pool.load(svc["id"], inflight=3, per={a: 2, b: 0, c: 1})
    assert pool.step().ended == []
    time.sleep(DRAIN_SETTLE_S + 0.1)
    pool.load(svc["id"], inflight=3, per={a: 2, b: 0, c: 1})
    rep = pool.step()
    assert rep.ended == [b] and rep.draining == []  # nothing in flight on it: released; the next waits
    ended = get(pool.api, b)
    assert ended["state"] == "released" and ended["reason"] == "drained: scaled down"
    time.sleep(max(0.0, drained_at + DELAY_S + 0.1 - time.monotonic()))
    pool.load(svc["id"], inflight=3, per={a: 2, c: 1})
    assert pool.step().draining == [c]
    drained_at = time.monotonic()
    # a draining replica with requests in flight stays until they finish
    pool.load(svc["id"], inflight=3, per={a: 2, c: 1})
    assert pool.step().ended == []
    time.sleep(DRAIN_SETTLE_S + 0.1)
    pool.load(svc["id"], inflight=2, per={a: 2, c: 0})
    assert pool.step().ended == [c]
    assert [r["allocation_id"] for r in pool.replicas("chat")] == [a]
    time.sleep(max(0.0, drained_at + DELAY_S + 0.1 - time.monotonic()))
    pool.load(svc["id"], inflight=0)
    assert pool.step().draining == []  # min_replicas 1


def test_scale_to_zero_after_idle_and_wake_on_a_queued_request(pool: Pool) -> None:
    pool.join("n1")
    svc = pool.put("chat", min_replicas=0, max_replicas=2, idle_s=3, scale_down_delay_s=0)
    assert pool.step().started == []  # min 0 and nothing asked: none
    pool.load(svc["id"], queued=1)  # a request waits in a gateway
    assert len(pool.step().started) == 1
    [r] = pool.ready("chat", 1)
    pool.load(svc["id"], inflight=1, per={r["allocation_id"]: 1})
    pool.step()
    with pool.api.app.state.db.write() as s:  # the gateway notes the request's arrival
        row = s.get(Service, svc["id"])
        assert row is not None
        row.last_request_at = db_now(s)
    pool.load(svc["id"])
    assert pool.step().draining == []  # not idle long enough
    assert pool.show("chat")["desired"] == 1
    time.sleep(3.1)
    pool.load(svc["id"])
    assert pool.step().draining == [r["allocation_id"]]
    out = pool.show("chat")
    assert out["desired"] == 0 and out["reason"].startswith("scaled to zero: idle"), out["reason"]
    time.sleep(DRAIN_SETTLE_S + 0.1)
    pool.load(svc["id"])
    assert pool.step().ended == [r["allocation_id"]]
    assert pool.replicas("chat") == []
    assert get(pool.api, r["allocation_id"])["reason"] == "drained: scaled down"
    pool.load(svc["id"], queued=2)  # wakes again
    rep = pool.step()
    assert len(rep.started) == 1 and pool.show("chat")["desired"] == 1


def test_unhealthy_and_never_healthy_replicas_are_replaced(pool: Pool) -> None:
    pool.join("n1")
    pool.put("chat", min_replicas=1, max_replicas=1, startup_grace_s=2)
    pool.step()
    [r] = pool.ready("chat", 1)
    port = int(r["endpoint"].rsplit(":", 1)[1])
    pool.servers[port].status = 503
    for _ in range(2):
        assert pool.step().ended == []
    assert pool.replicas("chat")[0]["replica_state"] == "ready"  # two failures are not three
    rep = pool.step()
    assert rep.ended == [r["allocation_id"]] and len(rep.started) == 1
    gone = get(pool.api, r["allocation_id"])
    assert gone["state"] == "cancelled" and gone["reason"].startswith("unhealthy: 3 health checks failed")
    assert "503" in gone["reason"]
    assert f"replica {r['allocation_id']} unhealthy" in pool.show("chat")["reason"]
    # the replacement runs but never answers: replaced after the start-up grace
    [new] = pool.replicas("chat")
    pool.run(new["allocation_id"], healthy=False)
    pool.servers.pop(port).close()
    assert pool.step().ended == []
    time.sleep(2.1)
    rep = pool.step()
    assert rep.ended == [new["allocation_id"]] and len(rep.started) == 1
    assert get(pool.api, new["allocation_id"])["reason"].startswith("not healthy within 2 s")


def test_failing_replicas_back_off(pool: Pool) -> None:
    pool.join("n1")
    pool.put("chat", min_replicas=1, startup_grace_s=1)
    pool.step()
    for _ in range(3):
        [r] = pool.replicas("chat")
        pool.run(r["allocation_id"], healthy=False)
        time.sleep(1.05)
        rep = pool.step()
        assert rep.ended == [r["allocation_id"]]
    assert rep.started == []  # the third failure in two minutes: wait
    assert "replicas keep failing" in pool.show("chat")["reason"]
    assert pool.replicas("chat") == []


def test_an_engine_that_keeps_exiting_is_restarted_then_backed_off(pool: Pool) -> None:
    n1 = pool.join("n1")
    pool.put("chat", min_replicas=1)
    rep = pool.step()
    for i in range(3):
        [alloc_id] = rep.started
        pool.run(alloc_id, healthy=False)
        a = get(pool.api, alloc_id)
        said = {"attempt": a["attempt"], "stream": "stderr", "offset": 0, "data": f"loading\nno model {i}\n"}
        pool.api.ok("POST", f"/api/v1/allocations/{alloc_id}/logs", json=said, headers=n1)
        exited = {"allocation_id": alloc_id, "attempt": a["attempt"], "state": "exited", "exit_code": 1}
        report(pool.api, "n1", n1, exited)
        assert get(pool.api, alloc_id)["state"] == "failed"
        rep = pool.step()
        assert len(rep.started) == (1 if i < 2 else 0), (i, rep)
    reason = pool.show("chat")["reason"]
    assert "replicas keep failing" in reason, reason
    assert f'replica {alloc_id} failed (exited 1 on n1; stderr: "loading | no model 2")' in reason, reason
    assert pool.step().started == []


def test_rolling_update_replaces_replicas_one_by_one(pool: Pool) -> None:
    pool.join("n1")
    pool.put("chat", min_replicas=2, max_replicas=2)
    pool.step()
    old = {r["allocation_id"] for r in pool.ready("chat", 2)}
    # scaling bounds only: a new generation, but nothing to replace
    out = pool.put("chat", expect=200, min_replicas=2, max_replicas=3)
    assert out["generation"] == 2 and {r["generation"] for r in out["replicas"]} == {2}
    assert pool.step().started == []
    # a new request: replaced one by one, never fewer than 2 ready
    changed = {"request": {"command": ["engine", "--v2"], "cpu_milli": 1000}}
    r = pool.api.put(f"{S}/chat", json={"spec": {**changed, "min_replicas": 2, "max_replicas": 3}},
                     headers=pool.api.admin)  # fmt: skip
    assert r.status_code == 200 and r.json()["generation"] == 3
    seen_ready: list[int] = []
    for _ in range(12):
        rep = pool.step()
        assert len(rep.started) <= 1
        reps = pool.replicas("chat")
        live = [x for x in reps if x["replica_state"] != "draining"]
        assert len(live) <= 3
        seen_ready.append(sum(x["replica_state"] == "ready" for x in reps))
        for x in reps:
            if x["state"] == "pending":
                pool.run(x["allocation_id"])
        if any(x["replica_state"] == "draining" for x in reps):
            time.sleep(DRAIN_SETTLE_S)  # released once the gateways surely saw it draining
        if all(x["generation"] == 3 and x["replica_state"] == "ready" for x in reps) and len(reps) == 2:
            break
    reps = pool.replicas("chat")
    assert len(reps) == 2 and {x["generation"] for x in reps} == {3}, reps
    assert not old & {x["allocation_id"] for x in reps}
    assert min(seen_ready) >= 2, seen_ready
    for i in old:
        a = get(pool.api, i)
        assert a["state"] == "released" and a["reason"] == "replaced by generation 3"
    assert get(pool.api, reps[0]["allocation_id"])["command"] == ["engine", "--v2"]


def test_a_lost_nodes_replica_is_requeued_and_runs_elsewhere(make_api: Any) -> None:
    lo = quiet_range(10)
    api = make_api(
        heartbeat_interval_s=0.2,
        suspect_after_s=0.6,
        lost_after_s=1.0,
        service_port_min=lo,
        service_port_max=lo + 9,
    )
    pool = Pool(api)
    try:
        n1 = pool.join("n1")
        pool.put("chat", min_replicas=1)
        pool.step()
        [r] = pool.ready("chat", 1)
        assert r["node"] == "n1"
        pool.servers.pop(int(r["endpoint"].rsplit(":", 1)[1])).close()  # n1 goes dark
        pool.dark.add("n1")
        api.ok("POST", "/api/v1/nodes/n1/heartbeat", headers=n1)
        n2 = pool.join("n2")
        time.sleep(0.7)
        api.ok("POST", "/api/v1/nodes/n2/heartbeat", headers=n2)
        time.sleep(0.5)
        api.ok("POST", "/api/v1/nodes/n2/heartbeat", headers=n2)
        cycle(api)  # n1 lost: the restartable replica is requeued (and bound again on n2)
        a = get(api, r["allocation_id"])
        assert a["attempt"] == 2 and a["state"] in ("pending", "bound"), a
        pool.step()
        [again] = pool.replicas("chat")
        assert again["allocation_id"] == r["allocation_id"] and again["replica_state"] == "starting"
        deadline = time.monotonic() + 20  # n2 must look alive to be chosen (a loaded machine: retry)
        while get(api, r["allocation_id"])["state"] == "pending" and time.monotonic() < deadline:
            api.ok("POST", "/api/v1/nodes/n2/heartbeat", headers=n2)
            cycle(api)
            time.sleep(0.2)
        a = get(api, r["allocation_id"])
        assert a["state"] == "bound" and a["nodes"] == ["n2"]
        report(api, "n2", n2, {"allocation_id": a["id"], "attempt": 2, "state": "running", "listener": "own"})
        pool.servers[int(a["env"]["PORT"])] = Health(int(a["env"]["PORT"]))
        pool.step()
        [again] = pool.replicas("chat")
        assert again["replica_state"] == "ready" and again["node"] == "n2"
    finally:
        pool.close()


def test_delete_drains_running_replicas_and_cancels_the_rest(pool: Pool) -> None:
    pool.join("n1")
    svc = pool.put("chat", min_replicas=2, max_replicas=3, drain_s=2)
    assert len(pool.step().started) == 2
    first, second = (r["allocation_id"] for r in pool.replicas("chat"))
    pool.run(first)
    assert pool.step().ready == [first]
    assert get(pool.api, second)["state"] == "bound"
    running, pending = [first], [second]
    gone = pool.api.ok("DELETE", f"{S}/chat")
    assert {r["allocation_id"]: r["replica_state"] for r in gone["replicas"]} == dict.fromkeys(
        running, "draining"
    )
    for i in pending:
        assert get(pool.api, i)["state"] == "cancelled"
    busy = dict.fromkeys(running, 1)
    pool.load(svc["id"], inflight=len(busy), per=busy)
    assert pool.step().ended == []  # requests in flight: they wait (up to drain_s)
    time.sleep(2.05)
    pool.load(svc["id"], inflight=len(busy), per=busy)
    assert pool.step().ended == running
    for i in running:
        assert get(pool.api, i)["reason"] == "drained: service deleted"
    assert pool.step().started == []


def test_only_the_lease_holder_runs_services(pool: Pool) -> None:
    pool.join("n1")
    pool.put("chat", min_replicas=1)
    pool.api.app.state.controller.acquire()  # this replica holds the scheduling lease
    other = Controller(pool.api.app.state.db, pool.api.settings, Hub(), holder="another-replica")
    assert other.acquire() is None
    rival = ServiceController(pool.api.app.state.db, pool.api.settings, Hub(), other.leadership)
    assert asyncio.run(rival.run_once()) == PassReport(leader=False)
    assert pool.replicas("chat") == []
    assert len(pool.step().started) == 1


def test_the_server_refuses_a_bad_service_port_range(tmp_path: Any) -> None:
    for ports, words in (("abc", "--service-ports: expected FIRST-LAST"), ("5000-4000", "must not exceed")):
        argv = [sys.executable, "-m", "computepool.cli.main", "server", "--data-dir", str(tmp_path)]
        out = subprocess.run([*argv, "--service-ports", ports], capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and words in out.stderr + out.stdout, out
        assert "Traceback" not in out.stderr


def test_a_container_replica_publishes_its_port(pool: Pool) -> None:
    pool.join("n1")
    request = {"command": ["engine"], "cpu_milli": 500, "image": "localhost/pybase:1", "ports": [20080]}
    pool.api.ok("POST", "/api/v1/images", json={"name": "localhost/pybase:1", "digest": "sha256:" + "c" * 64})
    r = pool.api.put(f"{S}/web", json={"spec": {"request": request}}, headers=pool.api.admin)
    assert r.status_code == 201, r.text
    [alloc_id] = pool.step().started
    a = get(pool.api, alloc_id)
    port = pool.api.settings.service_port_min
    assert sorted(a["request"]["ports"]) == sorted([20080, port])
    assert a["env"] == {"PORT": str(port), "CPOOL_SERVICE_KEY": "(hidden)"}
    assert a["request"]["image"] == "localhost/pybase:1"
