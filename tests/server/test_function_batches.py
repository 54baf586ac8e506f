"""Function calls in batches: a worker claims its share of the waiting calls and hands in several
results at once (`POST /worker/calls`); a submission hands its calls to a worker parked in a
long-poll and can wait for their results; a worker that dies fails every call it held."""

from __future__ import annotations

import base64
import threading
import time
from typing import Any

from harness import Api, H
from test_allocations import cycle, manual
from test_functions_api import b64, bearer, join, register, report, results, submit, worker_tokens

from computepool.server.logic.function_workers import sweep

F = "/api/v1/functions"


def claim(api: Api, token: str, done: list[dict[str, Any]] | None = None, **kw: Any) -> Any:
    return api.post("/api/v1/worker/calls", json={"done": done or [], **kw}, headers=bearer(token))


def ok(cid: int, value: bytes) -> dict[str, Any]:
    return {"id": cid, "ok": True, "result": b64(value)}


def two_workers(api: Api, n: int, **over: Any) -> tuple[int, list[int], list[str], H]:
    """A function with two workers started for `n` waiting calls: (fid, call ids, tokens, node)."""
    manual(api)
    node = join(api, "n1", ["3.11"], devices=0)
    fid = register(api, **({"max_workers": 2} | over))["id"]
    ids = submit(api, fid, *[str(i).encode() for i in range(n)])
    cycle(api)
    tokens = [t for _, t in sorted(worker_tokens(api, "n1", node).items())]
    return fid, ids, tokens, node


def test_a_worker_claims_its_share_oldest_first_and_hands_in_a_batch(api: Api) -> None:
    fid, ids, (t1, t2), _ = two_workers(api, 10)
    # its share: the calls waiting over the function's workers (10 // 2), at most what it asks
    first = claim(api, t1, max_calls=8).json()
    assert first["stop"] is False and [c["id"] for c in first["calls"]] == ids[:5]
    assert [base64.b64decode(c["args"]) for c in first["calls"]] == [str(i).encode() for i in range(5)]
    second = claim(api, t2, max_calls=8).json()  # 5 left over 2 workers: 2
    assert [c["id"] for c in second["calls"]] == ids[5:7]
    assert api.ok("GET", f"{F}/{fid}")["calls_pending"] == 3

    # a result for a call another worker holds: 409 naming its place in the batch, nothing recorded
    r = claim(api, t2, [ok(ids[5], b"x"), ok(ids[0], b"y")])
    assert r.status_code == 409 and r.json()["field"] == "done[1].id", r.text
    assert results(api, fid, ids[5:6]) == []

    # five results in one request, and the next share claimed in the same answer
    nxt = claim(api, t1, [ok(c, b"r%d" % c) for c in ids[:5]], max_calls=8).json()
    assert [c["id"] for c in nxt["calls"]] == ids[7:8]  # 3 waiting // 2 workers: 1
    got = {c["id"]: c for c in results(api, fid, ids[:5])}
    assert set(got) == set(ids[:5]) and all(c["state"] == "done" for c in got.values())
    assert base64.b64decode(got[ids[3]]["result"]) == b"r%d" % ids[3]
    # the same batch handed in again (a retried request) is taken as it is
    assert claim(api, t1, [ok(c, b"r%d" % c) for c in ids[:5]], max_calls=0).json() == {
        "calls": [],
        "stop": False,
        "drop": [],
    }
    # the last calls go one per claim: no worker sits on calls the others could run
    assert len(claim(api, t2, max_calls=8).json()["calls"]) == 1
    assert len(claim(api, t1, max_calls=8).json()["calls"]) == 1
    assert claim(api, t2, max_calls=8).json()["calls"] == []

    for body, field in [
        ({"max_calls": 65}, "max_calls"),
        ({"max_calls": True}, "max_calls"),
        ({"done": [{"id": ids[0], "ok": "yes"}]}, "done[0].ok"),
        ({"wait_s": 61}, "wait_s"),
        ({"more": 1}, "more"),
    ]:
        r = api.post("/api/v1/worker/calls", json=body, headers=bearer(t1))
        assert r.status_code == 422 and r.json()["field"] == field, (body, r.text)


def test_a_one_call_worker_claims_one_call_whatever_it_asks(api: Api) -> None:
    _, ids, (t1, _t2), _ = two_workers(api, 4, keep_warm_s=0)
    assert [c["id"] for c in claim(api, t1, max_calls=8).json()["calls"]] == ids[:1]
    assert claim(api, t1, [ok(ids[0], b"a")], max_calls=8).json() == {"calls": [], "stop": True, "drop": []}


def test_a_parked_worker_is_handed_the_call_and_the_caller_waits_for_its_result(api: Api) -> None:
    fid, [first, second], (t1, t2), _ = two_workers(api, 2)
    assert [c["id"] for c in claim(api, t1).json()["calls"]] == [first]
    assert [c["id"] for c in claim(api, t2).json()["calls"]] == [second]
    out: dict[str, Any] = {}

    def park() -> None:  # hands in its result, finds nothing waiting: parks
        out["worker"] = claim(api, t2, [ok(second, b"2")], max_calls=4, wait_s=30).json()

    parked = threading.Thread(target=park)
    parked.start()
    handoff = api.app.state.handoff
    assert wait_until(lambda: handoff.parked(fid) == 1)

    def call() -> None:
        body = {"calls": [{"args": b64(b"late")}], "wait_s": 5}
        out["caller"] = api.ok("POST", f"{F}/{fid}/calls", json=body)

    caller = threading.Thread(target=call)
    caller.start()
    parked.join(20)
    # the submission claimed the call for the parked worker: it answers with it, no read of its own
    [handed] = out["worker"]["calls"]
    assert base64.b64decode(handed["args"]) == b"late" and handoff.parked(fid) == 0
    state = api.ok("GET", f"{F}/{fid}")
    assert state["calls_pending"] == 0 and state["workers_live"] == 2  # no worker started for it
    assert claim(api, t2, [ok(handed["id"], b"LATE")], max_calls=0).status_code == 200
    caller.join(20)
    # the caller's submission waited for the result and carries it
    assert out["caller"]["ids"] == [handed["id"]]
    [c] = out["caller"]["calls"]
    assert c["state"] == "done" and base64.b64decode(c["result"]) == b"LATE"

    # nothing ended within wait_s: the ids alone, to be polled
    r = api.ok("POST", f"{F}/{fid}/calls", json={"calls": [{"args": b64(b"z")}], "wait_s": 0.2})
    assert len(r["ids"]) == 1 and r["calls"] == []
    bad = api.post(f"{F}/{fid}/calls", json={"calls": [{"args": b64(b"z")}], "wait_s": 6}, headers=api.admin)
    assert bad.status_code == 422 and bad.json()["field"] == "wait_s"


def test_a_worker_that_dies_fails_every_call_it_held_and_no_other(api: Api) -> None:
    fid, ids, (t1, t2), node = two_workers(api, 8)
    held = [c["id"] for c in claim(api, t1, max_calls=8).json()["calls"]]
    assert held == ids[:4]
    claim(api, t1, [ok(held[0], b"0")], max_calls=0)  # one result went back before it died
    w1 = min(worker_tokens(api, "n1", node))
    report(api, "n1", node, w1, state="running")
    report(api, "n1", node, w1, state="exited", exit_code=137, reason="killed by signal 9")
    sweep(api.app.state.db)
    out = {c["id"]: c for c in results(api, fid, ids)}
    assert out[held[0]]["state"] == "done"
    for cid in held[1:]:  # claimed, whether or not it had begun: failed with the pool's reason
        assert out[cid]["state"] == "failed" and out[cid]["ok"] is None
        assert out[cid]["error"].startswith("worker ended: failed"), out[cid]
    assert set(out) == set(held)  # the calls it never claimed still wait, for the other worker
    assert [c["id"] for c in claim(api, t2, max_calls=8).json()["calls"]] == ids[4:6]


def wait_until(check: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def test_a_submission_sent_again_with_its_key_stores_its_calls_once(api: Api) -> None:
    manual(api)
    join(api, "n1", ["3.11"], devices=0)
    fid = register(api, max_workers=1)["id"]
    body = {"calls": [{"args": b64(b"a")}, {"args": b64(b"b")}], "key": "k" * 32}
    first = api.ok("POST", f"{F}/{fid}/calls", json=body)["ids"]
    # the answer was lost to an outage: the caller sends it again, and gets the same calls
    assert api.ok("POST", f"{F}/{fid}/calls", json=body)["ids"] == first
    assert api.ok("GET", f"{F}/{fid}")["calls_pending"] == 2
    other = api.ok("POST", f"{F}/{fid}/calls", json=body | {"key": "j" * 32})["ids"]
    assert len(other) == 2 and not set(other) & set(first)
    for key in ("short", "k" * 65, "no spaces allowed here!"):
        r = api.post(f"{F}/{fid}/calls", json=body | {"key": key}, headers=api.admin)
        assert r.status_code == 422 and r.json()["field"] == "key", r.text


def test_cancelling_a_call_of_a_batch_spares_the_others_and_the_worker_drops_it(api: Api) -> None:
    fid, ids, (t1, _t2), node = two_workers(api, 8)
    a, b, c, d = (x["id"] for x in claim(api, t1, max_calls=8).json()["calls"])
    w1 = min(worker_tokens(api, "n1", node))
    r = api.request("DELETE", f"{F}/{fid}/calls/{c}", headers=api.admin)
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    # the worker still holds a, b and d: it is not ended for c, and they are not failed
    assert api.ok("GET", f"/api/v1/allocations/{w1}")["state"] in ("bound", "active")
    # it hands a in, still holding b, c, d not begun: told to drop c
    answer = claim(api, t1, [ok(a, b"A")], max_calls=0, holding=[b, c, d]).json()
    assert answer == {"calls": [], "stop": False, "drop": [c]}
    claim(api, t1, [ok(b, b"B")], max_calls=0)
    # the last call it holds, cancelled: the worker is ended with it, as a lone running call's is
    api.request("DELETE", f"{F}/{fid}/calls/{d}", headers=api.admin)
    assert api.ok("GET", f"/api/v1/allocations/{w1}")["state"] == "cancelled"
    out = {x["id"]: x["state"] for x in results(api, fid, [a, b, c, d])}
    assert out == {a: "done", b: "done", c: "cancelled", d: "cancelled"}
    r = api.post("/api/v1/worker/calls", json={"holding": [0]}, headers=bearer(t1))
    assert r.status_code in (401, 403, 422)
