"""Remote functions on the control plane: registration, calls, the worker's routes, results, cancel.

The worker here is played over HTTP with the token the node's agent receives in the assignment;
nodes report Python versions when they join or in a heartbeat; the scheduler cycles are run by hand.
"""

from __future__ import annotations

import base64
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from harness import Api, H
from test_allocations import cycle, manual

from computepool.server.logic.function_workers import sweep
from computepool.store import functions as fn_store

F = "/api/v1/functions"
CMD = ["/usr/bin/python3", "-u", "worker.py"]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def join(api: Api, name: str, pythons: list[str] | None, devices: int = 1) -> H:
    token = api.ok("POST", "/api/v1/join-tokens", json={})["token"]
    body: dict[str, Any] = {
        "join_token": token,
        "name": name,
        "cpu_milli": 8000,
        "memory_mib": 16384,
        "labels": {"zone": "a"},
        "devices": [
            {"index": i, "vendor": "simulated", "model": "A100", "memory_mib": 40960, "uuid": f"G-{name}{i}"}
            for i in range(devices)
        ],
    }
    if pythons is not None:
        body["pythons"] = pythons
    cred = api.ok("POST", "/api/v1/nodes/join", json=body, headers={})["credential"]
    return {"Authorization": f"Bearer {cred}"}


def register(api: Api, headers: H | None = None, expect: int = 201, **over: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "square",
        "request": {"cpu_milli": 500, "command": CMD, "env": {"A": "1"}},
        "python": "3.11",
        "keep_warm_s": 30,
        "max_workers": 2,
    }
    body.update(over)
    r = api.post(F, json=body, headers=headers or api.admin)
    assert r.status_code == expect, r.text
    return dict(r.json())


def submit(api: Api, fid: int, *payloads: bytes, headers: H | None = None) -> list[int]:
    body = {"calls": [{"args": b64(p)} for p in payloads]}
    return list(api.ok("POST", f"{F}/{fid}/calls", json=body, headers=headers)["ids"])


def results(api: Api, fid: int, ids: list[int], headers: H | None = None, **kw: Any) -> list[dict[str, Any]]:
    return list(api.ok("POST", f"{F}/{fid}/results", json={"ids": ids, **kw}, headers=headers)["calls"])


def worker_tokens(api: Api, node: str, node_headers: H) -> dict[int, str]:
    """allocation id → CPOOL_WORKER_TOKEN, as the node's agent receives them."""
    got = api.ok("GET", f"/api/v1/nodes/{node}/assignments", headers=node_headers)["assignments"]
    return {
        a["allocation_id"]: a["env"]["CPOOL_WORKER_TOKEN"] for a in got if "CPOOL_WORKER_TOKEN" in a["env"]
    }


def bearer(token: str) -> H:
    return {"Authorization": f"Bearer {token}"}


def next_call(api: Api, token: str, done: dict[str, Any] | None = None, wait_s: float = 0) -> Any:
    return api.post("/api/v1/worker/next", json={"done": done, "wait_s": wait_s}, headers=bearer(token))


def report(api: Api, node: str, node_headers: H, alloc_id: int, **state: Any) -> None:
    api.ok(
        "POST",
        f"/api/v1/nodes/{node}/reports",
        headers=node_headers,
        json={"reports": [{"allocation_id": alloc_id, "attempt": 1, **state}]},
    )


# --- registration ---------------------------------------------------------------------------------
def test_register_idempotent_python_and_bad_input(api: Api) -> None:
    manual(api)
    r = api.post(F, json={"name": "f", "request": {"command": CMD}}, headers=api.admin)
    assert r.status_code == 422 and r.json()["field"] == "python"
    assert "needs Python 3.11" in r.json()["error"] and "report no Python" in r.json()["error"]
    n1 = join(api, "n1", ["3.11"])
    node = api.ok("GET", "/api/v1/nodes/n1")
    assert node["pythons"] == ["3.11"] and node["labels"]["cpool.io/python-3.11"] == "yes"

    r = api.post(F, json={"name": "f", "request": {"command": CMD}, "python": "3.12"}, headers=api.admin)
    assert r.status_code == 422, r.text
    assert r.json() == {
        "error": "this function needs Python 3.12 (the caller's); the pool's nodes provide 3.11",
        "field": "python",
    }
    first = register(api)
    assert first["workers_live"] == 0 and first["calls_pending"] == 0 and first["tenant"] == "default"
    again = register(api, expect=200)
    assert again["id"] == first["id"]
    other = register(api, keep_warm_s=0)
    assert other["id"] != first["id"]
    assert {f["id"] for f in api.ok("GET", F)["items"]} == {first["id"], other["id"]}
    assert api.ok("GET", f"{F}/{first['id']}")["name"] == "square"

    # the per-worker request is judged as POST /allocations judges it; refusals name the field
    bad = [
        ({"request": {"cpu_milli": 1}}, "request.command"),
        ({"request": {"command": CMD, "gpus": 4}}, "request.gpus"),
        ({"request": {"command": CMD, "gang_nodes": 2}}, "request.gang_nodes"),
        ({"request": {"command": CMD, "code": "ab" * 32}}, "request.code"),
        ({"request": {"command": CMD, "cpu_milli": "lots"}}, "request.cpu_milli"),
        ({"max_workers": 0}, "max_workers"),
        ({"max_workers": 257}, "max_workers"),
        ({"keep_warm_s": 86401}, "keep_warm_s"),
        ({"python": "three"}, "python"),
        ({"name": "Bad Name"}, "name"),
        ({"colour": "red"}, "colour"),
    ]
    for over, field in bad:
        r = api.post(F, json={"name": "g", "request": {"command": CMD}, **over}, headers=api.admin)
        assert r.status_code == 422 and r.json()["field"] == field, (over, r.text)
    assert api.get(f"{F}/99999", headers=api.admin).status_code == 404
    assert api.get(f"{F}/{10**30}", headers=api.admin).status_code == 404

    # python labels survive an admin's PUT of the labels; a heartbeat may report more versions
    api.ok("PUT", "/api/v1/nodes/n1", json={"labels": {"rack": "r1"}})
    assert api.ok("GET", "/api/v1/nodes/n1")["labels"] == {
        "rack": "r1",
        "cpool.io/python-3.11": "yes",
        "cpool.io/node": "n1",
    }
    api.ok("POST", "/api/v1/nodes/n1/heartbeat", headers=n1, json={"pythons": ["3.12", "3.11"]})
    node = api.ok("GET", "/api/v1/nodes/n1")
    assert node["pythons"] == ["3.11", "3.12"] and node["labels"]["cpool.io/python-3.12"] == "yes"
    assert register(api, python="3.12")["python"] == "3.12"


def test_other_tenants_get_404_and_viewers_only_read(api: Api) -> None:
    manual(api)
    join(api, "n1", ["3.11"])
    api.tenant("blue")
    api.tenant("red")
    blue = api.user("bob", "blue", "member")
    blue_viewer = api.user("vic", "blue", "viewer")
    red = api.user("rita", "red", "member")
    fn = register(api, headers=blue)
    [cid] = submit(api, fn["id"], b"x", headers=blue)
    assert fn["tenant"] == "blue" and fn["owner"] == "bob"
    for method, path, body in [
        ("GET", f"{F}/{fn['id']}", None),
        ("DELETE", f"{F}/{fn['id']}", None),
        ("POST", f"{F}/{fn['id']}/calls", {"calls": [{"args": b64(b"y")}]}),
        ("POST", f"{F}/{fn['id']}/results", {"ids": [cid]}),
        ("DELETE", f"{F}/{fn['id']}/calls/{cid}", None),
    ]:
        r = api.request(method, path, json=body, headers=red)
        assert r.status_code == 404 and r.json()["error"] == f"function '{fn['id']}' not found", r.text
    assert api.ok("GET", F, headers=red)["items"] == []
    assert [f["id"] for f in api.ok("GET", F, headers=blue_viewer)["items"]] == [fn["id"]]
    assert results(api, fn["id"], [cid], headers=blue_viewer) == []
    r = api.post(f"{F}/{fn['id']}/calls", json={"calls": [{"args": b64(b"z")}]}, headers=blue_viewer)
    assert r.status_code == 403
    # the same spec from another tenant is another function
    assert register(api, headers=red)["id"] != fn["id"]
    # a call id of another function of the same tenant is not found there
    fn2 = register(api, headers=blue, name="cube")
    r = api.post(f"{F}/{fn2['id']}/results", json={"ids": [cid]}, headers=blue)
    assert r.status_code == 404 and r.json()["error"] == f"call '{cid}' not found"


# --- calls and workers ----------------------------------------------------------------------------
def test_worker_claims_runs_and_results_long_poll(api: Api) -> None:
    manual(api)
    n1 = join(api, "n1", ["3.11"], devices=0)
    fn = register(api)
    fid = fn["id"]
    ids = submit(api, fid, b"one", b"two", b"three")
    assert ids == sorted(ids) and len(ids) == 3
    got = api.ok("GET", f"{F}/{fid}")
    assert got["workers_live"] == 2 and got["calls_pending"] == 3  # max_workers caps the start

    workers = [a for a in api.ok("GET", "/api/v1/allocations")["items"] if a["name"] == "fn-square"]
    assert len(workers) == 2
    for w in workers:  # the token is for the agent only; the rest of the spec is as registered
        assert w["env"]["CPOOL_WORKER_TOKEN"] == "(hidden)"
        assert w["request"]["env"]["CPOOL_WORKER_TOKEN"] == "(hidden)"
        assert w["env"]["CPOOL_FUNCTION_ID"] == str(fid) and w["env"]["A"] == "1"
        assert w["env"]["CPOOL_KEEP_WARM_S"] == "30" and w["command"] == CMD
        assert w["request"]["node_selector"] == {"cpool.io/python-3.11": "yes"}
        assert w["owner"] == "admin" and not w["restartable"]
    cycle(api)
    tokens = worker_tokens(api, "n1", n1)
    assert set(tokens) == {w["id"] for w in workers}
    w1, w2 = sorted(tokens)
    t1, t2 = tokens[w1], tokens[w2]

    # a worker token reaches nothing but its own function's worker routes
    assert api.get("/api/v1/allocations", headers=bearer(t1)).status_code == 403
    assert api.get(f"{F}/{fid}", headers=bearer(t1)).status_code == 403
    assert (
        api.post(f"{F}/{fid}/calls", json={"calls": [{"args": "eA=="}]}, headers=bearer(t1)).status_code
        == 403
    )
    assert api.get("/api/v1/whoami", headers=bearer(t1)).status_code == 403

    first = next_call(api, t1).json()
    assert first["stop"] is False and first["call"]["id"] == ids[0]
    assert base64.b64decode(first["call"]["args"]) == b"one"
    second = next_call(api, t2).json()
    assert second["call"]["id"] == ids[1]
    assert api.ok("GET", f"{F}/{fid}")["calls_pending"] == 1

    # printed output streams to a caller waiting on results, from the offset it asks
    waited: dict[str, Any] = {}

    def wait_results() -> None:
        t0 = time.monotonic()
        waited["calls"] = results(api, fid, ids, wait_s=20)
        waited["took"] = time.monotonic() - t0

    th = threading.Thread(target=wait_results)
    th.start()
    time.sleep(0.3)
    assert "calls" not in waited  # nothing ended, nothing printed yet
    out = api.post("/api/v1/worker/output", json={"id": ids[0], "data": "hello "}, headers=bearer(t1))
    assert out.status_code == 200 and out.json() == {"accepted": True}
    th.join(10)
    assert waited["took"] < 5, waited
    [c] = waited["calls"]
    assert c["id"] == ids[0] and c["state"] == "running" and c["output"] == "hello " and c["output_next"] == 6
    api.ok("POST", "/api/v1/worker/output", headers=bearer(t1), json={"id": ids[0], "data": "world"})
    [c] = results(api, fid, ids, output_from={str(ids[0]): 6})
    assert c["output"] == "world" and c["output_next"] == 11
    assert results(api, fid, ids, output_from={str(ids[0]): 11}) == []
    # only the worker that claimed a call may speak for it
    r = api.post("/api/v1/worker/output", json={"id": ids[0], "data": "x"}, headers=bearer(t2))
    assert r.status_code == 409 and r.json()["field"] == "id"
    r = next_call(api, t2, {"id": ids[0], "ok": True, "result": b64(b"no")})
    assert r.status_code == 409 and r.json()["field"] == "done.id"

    # done: the result is recorded and the worker takes the next waiting call in the same answer
    nxt = next_call(api, t1, {"id": ids[0], "ok": True, "result": b64(b"1")}).json()
    assert nxt["call"]["id"] == ids[2]
    tb = "Traceback (most recent call last):\n  ValueError: two\n"
    r = next_call(api, t2, {"id": ids[1], "ok": False, "result": b64(b"exc"), "traceback": tb})
    assert r.json() == {"call": None, "stop": False}
    done = {c["id"]: c for c in results(api, fid, ids)}
    assert set(done) == {ids[0], ids[1]}
    assert done[ids[0]]["state"] == "done" and done[ids[0]]["ok"] is True
    assert base64.b64decode(done[ids[0]]["result"]) == b"1" and done[ids[0]]["output"] == "hello world"
    assert done[ids[1]]["state"] == "failed" and done[ids[1]]["ok"] is False
    assert done[ids[1]]["traceback"] == tb and done[ids[1]]["error"] is None

    # an idle worker long-polls; a new call wakes it at once
    got_next: dict[str, Any] = {}

    def wait_next() -> None:
        t0 = time.monotonic()
        got_next["answer"] = next_call(api, t2, wait_s=20).json()
        got_next["took"] = time.monotonic() - t0

    th = threading.Thread(target=wait_next)
    th.start()
    time.sleep(0.3)
    assert "answer" not in got_next
    [late] = submit(api, fid, b"four")
    th.join(10)
    assert got_next["answer"]["call"]["id"] == late and got_next["took"] < 5, got_next
    assert api.ok("GET", f"{F}/{fid}")["workers_live"] == 2  # an idle worker was live: none started

    # bad input to the worker routes: 422 naming the field
    for body, field in [
        ({"done": {"id": late, "ok": "yes"}}, "done.ok"),
        ({"done": {"id": late, "ok": True, "result": "not base64!"}}, "done.result"),
        ({"wait_s": 61}, "wait_s"),
        ({"extra": 1}, "extra"),
    ]:
        r = api.post("/api/v1/worker/next", json=body, headers=bearer(t2))
        assert r.status_code == 422 and r.json()["field"] == field, (body, r.text)


def test_keep_warm_zero_stops_after_one_call_and_delete(api: Api) -> None:
    manual(api)
    n1 = join(api, "n1", ["3.11"], devices=0)
    fn = register(api, keep_warm_s=0, max_workers=1)
    fid = fn["id"]
    [a, b] = submit(api, fid, b"a", b"b")
    cycle(api)
    [(w1, t1)] = worker_tokens(api, "n1", n1).items()
    assert next_call(api, t1).json()["call"]["id"] == a
    assert next_call(api, t1, {"id": a, "ok": True, "result": b64(b"A")}).json() == {
        "call": None,
        "stop": True,
    }
    report(api, "n1", n1, w1, state="exited", exit_code=0)
    assert api.ok("GET", f"/api/v1/allocations/{w1}")["state"] == "released"
    assert next_call(api, t1).status_code in (401, 403)  # its allocation ended: the token is dead
    sweep(api.app.state.db)  # the next worker starts for the waiting call
    cycle(api)
    [(w2, t2)] = worker_tokens(api, "n1", n1).items()
    assert w2 != w1 and next_call(api, t2).json()["call"]["id"] == b

    # delete: waiting and running calls and the workers are cancelled; a new registration revives it
    [c] = submit(api, fid, b"c")
    gone = api.request("DELETE", f"{F}/{fid}", headers=api.admin)
    assert gone.status_code == 200
    assert api.get(f"{F}/{fid}", headers=api.admin).status_code == 404
    assert api.ok("GET", f"/api/v1/allocations/{w2}")["state"] == "cancelled"
    assert register(api, keep_warm_s=0, max_workers=1, expect=200)["id"] == fid
    ended = {x["id"]: x for x in results(api, fid, [b, c])}
    assert ended[b]["state"] == "cancelled" and ended[c]["state"] == "cancelled"
    assert ended[c]["error"] == "function deleted"
    # ended calls are forgotten after the retention: their ids are then unknown
    with api.app.state.db.write() as s:
        assert fn_store.forget_ended(s, datetime.now(UTC) - timedelta(hours=1)) == 0
        assert fn_store.forget_ended(s, datetime.now(UTC) + timedelta(seconds=5)) == 3
    r = api.post(f"{F}/{fid}/results", json={"ids": [a]}, headers=api.admin)
    assert r.status_code == 404 and r.json()["field"] == "ids"


def test_workers_land_only_where_their_python_runs(api: Api) -> None:
    manual(api)
    join(api, "n0", None, devices=0)  # an older agent: reports no Python
    join(api, "n1", ["3.11"], devices=0)
    join(api, "n2", ["3.12"], devices=0)
    fid = register(api, max_workers=4)["id"]
    submit(api, fid, b"1", b"2", b"3", b"4")
    cycle(api)
    workers = [a for a in api.ok("GET", "/api/v1/allocations")["items"] if a["name"] == "fn-square"]
    assert len(workers) == 4 and all(w["nodes"] == ["n1"] for w in workers), workers


def test_cancel_and_worker_end_fail_calls(api: Api) -> None:
    manual(api)
    n1 = join(api, "n1", ["3.11"], devices=0)
    fid = register(api, max_workers=1)["id"]
    [a, b, c] = submit(api, fid, b"a", b"b", b"c")
    r = api.request("DELETE", f"{F}/{fid}/calls/{c}", headers=api.admin)
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    assert r.json()["error"] == "cancelled by user:admin"
    assert api.request("DELETE", f"{F}/{fid}/calls/{c}", headers=api.admin).status_code == 409
    assert api.request("DELETE", f"{F}/{fid}/calls/424242", headers=api.admin).status_code == 404
    cycle(api)
    [(w1, t1)] = worker_tokens(api, "n1", n1).items()
    assert next_call(api, t1).json()["call"]["id"] == a
    report(api, "n1", n1, w1, state="running")
    # the worker's process dies while it holds call a: a fails with the allocation's reason
    report(api, "n1", n1, w1, state="exited", exit_code=3, reason="segfault")
    sweep(api.app.state.db)
    [failed] = results(api, fid, [a])
    assert failed["state"] == "failed" and failed["ok"] is None
    assert failed["error"] == "worker ended: failed (exited 3 on n1: segfault)"
    assert next_call(api, t1).status_code in (401, 403)

    # cancelling a running call ends its worker allocation
    cycle(api)
    [(w2, t2)] = worker_tokens(api, "n1", n1).items()
    assert next_call(api, t2).json()["call"]["id"] == b
    r = api.request("DELETE", f"{F}/{fid}/calls/{b}", headers=api.admin)
    assert r.json()["state"] == "cancelled"
    assert api.ok("GET", f"/api/v1/allocations/{w2}")["state"] == "cancelled"
    assert next_call(api, t2).status_code in (401, 403)

    # workers that fail before claiming anything: after two in a row, waiting calls fail with why
    [d, e] = submit(api, fid, b"d", b"e")
    for _ in range(2):
        sweep(api.app.state.db)
        cycle(api)
        [(w, _t)] = worker_tokens(api, "n1", n1).items()
        report(api, "n1", n1, w, state="failed", reason="command not found: python3.11")
    sweep(api.app.state.db)
    out = {x["id"]: x for x in results(api, fid, [d, e])}
    assert out[d]["state"] == out[e]["state"] == "failed"
    assert "command not found: python3.11" in out[d]["error"] and "2 workers in a row" in out[d]["error"]
    now = api.ok("GET", f"{F}/{fid}")
    assert now["workers_live"] == 0 and now["calls_pending"] == 0


def test_bad_call_input(api: Api) -> None:
    manual(api)
    join(api, "n1", ["3.11"])
    fid = register(api)["id"]
    for body, field in [
        ({"calls": []}, "calls"),
        ({"calls": [{"args": "***"}]}, "calls[0].args"),
        ({"calls": [{"args": "eA==", "kw": 1}]}, "calls[0].kw"),
        ({"calls": [{"args": "eA=="}] * 1001}, "calls"),
    ]:
        r = api.post(f"{F}/{fid}/calls", json=body, headers=api.admin)
        assert r.status_code == 422 and r.json()["field"] == field, (field, r.text[:300])
    for body, field in [
        ({"ids": []}, "ids"),
        ({"ids": [0]}, "ids[0]"),
        ({"ids": [1], "wait_s": 61}, "wait_s"),
        ({"ids": [1], "output_from": {"1": -1}}, "output_from.1"),
    ]:
        r = api.post(f"{F}/{fid}/results", json=body, headers=api.admin)
        assert r.status_code == 422 and r.json()["field"] == field, (field, r.text)
    assert api.ok("GET", f"{F}/{fid}")["calls_pending"] == 0  # nothing stored by refused calls


def test_two_servers_workers_claim_each_call_once(make_api: Any) -> None:
    """Two app instances on one database (replicas); workers race on both: every call runs once."""
    a: Api = make_api()
    b: Api = make_api()
    manual(a)
    manual(b)
    n1 = join(a, "n1", ["3.11"], devices=0)
    fid = register(a, max_workers=4)["id"]
    ids = submit(a, fid, *[str(i).encode() for i in range(40)])
    cycle(a)
    tokens = list(worker_tokens(b, "n1", n1).values())
    assert len(tokens) == 4
    claimed: list[tuple[int, int]] = []
    lock = threading.Lock()

    def work(k: int, token: str) -> None:
        done = None
        for turn in range(100):
            api = (a, b)[(k + turn) % 2]
            r = next_call(api, token, done)
            assert r.status_code == 200, r.text
            call = r.json()["call"]
            if call is None:
                return
            with lock:
                claimed.append((call["id"], k))
            done = {"id": call["id"], "ok": True, "result": call["args"]}

    threads = [threading.Thread(target=work, args=(k, t)) for k, t in enumerate(tokens)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(c for c, _ in claimed) == ids  # each exactly once
    assert len({k for _, k in claimed}) > 1  # the workers shared the queue
    out = results(b, fid, ids)
    assert all(c["state"] == "done" for c in out) and len(out) == len(ids)
    assert {c["id"]: base64.b64decode(c["result"]) for c in out} == {
        i: str(n).encode() for n, i in enumerate(ids)
    }


def test_a_worker_that_delivered_breaks_a_run_of_failures(api: Api) -> None:
    """Two workers failing in a row fail the waiting calls; a one-call worker that delivered in
    between breaks the run (it is settled when told to stop, so the sweep never counted it)."""
    manual(api)
    n1 = join(api, "n1", ["3.11"], devices=0)
    fid = register(api, keep_warm_s=0, max_workers=1)["id"]
    [a, b, c] = submit(api, fid, b"a", b"b", b"c")
    cycle(api)
    [w1] = worker_tokens(api, "n1", n1)
    report(api, "n1", n1, w1, state="failed", reason="node hiccup")  # failure 1, nothing claimed
    sweep(api.app.state.db)
    cycle(api)
    [(w2, t2)] = worker_tokens(api, "n1", n1).items()
    assert next_call(api, t2).json()["call"]["id"] == a
    assert next_call(api, t2, {"id": a, "ok": True, "result": b64(b"A")}).json()["stop"] is True
    report(api, "n1", n1, w2, state="exited", exit_code=0)  # it delivered
    sweep(api.app.state.db)
    cycle(api)
    w3 = max(worker_tokens(api, "n1", n1))
    report(api, "n1", n1, w3, state="failed", reason="node hiccup again")  # failure 2, not in a row
    sweep(api.app.state.db)
    assert not [x for x in results(api, fid, [b, c]) if x["state"] == "failed"]


def test_pending_workers_no_call_needs_are_withdrawn(api: Api) -> None:
    """A map's calls all taken (here: cancelled) while its workers still wait for room: those
    workers are withdrawn, not left to start later and hold resources for keep_warm_s."""
    manual(api)  # no scheduler cycle: the workers stay pending
    join(api, "nw", ["3.11"], devices=0)
    fid = register(api, name="withdrawn", max_workers=2)["id"]
    calls = submit(api, fid, b"a", b"b")
    sweep(api.app.state.db)
    with api.app.state.db.read() as s:
        workers = fn_store.live_worker_ids(s, fid)
    assert len(workers) == 2  # calls wait: their workers are kept
    assert {api.ok("GET", f"/api/v1/allocations/{w}")["state"] for w in workers} == {"pending"}
    for c in calls:
        api.ok("DELETE", f"{F}/{fid}/calls/{c}")
    sweep(api.app.state.db)
    for w in workers:
        got = api.ok("GET", f"/api/v1/allocations/{w}")
        assert (got["state"], got["reason"]) == ("cancelled", "withdrawn: no call waits for this worker")
    assert api.ok("GET", f"{F}/{fid}")["workers_live"] == 0
