"""A `.remote()` submission (one call, `wait_s`) waits for its call's outcome: the hand-in that ends
the call on the same replica gives it the call's row; output printed meanwhile, a cancel, or a
hand-in on another replica reach it through the database, as any results poll."""

from __future__ import annotations

import base64
import threading
from typing import Any

from harness import Api
from test_allocations import cycle, manual
from test_function_batches import claim, ok, two_workers, wait_until
from test_functions_api import b64, bearer, join, register, worker_tokens

F = "/api/v1/functions"


def waiting_call(api: Api, fid: int, out: dict[str, Any], args: bytes, wait_s: float = 5) -> threading.Thread:
    """A `.remote()`-style submission in a thread; its answer lands in out["caller"]."""

    def call() -> None:
        body = {"calls": [{"args": b64(args)}], "wait_s": wait_s}
        out["caller"] = api.ok("POST", f"{F}/{fid}/calls", json=body)

    t = threading.Thread(target=call)
    t.start()
    return t


def test_the_hand_in_answers_the_waiting_submission_and_no_watch_stays(api: Api) -> None:
    fid, [first, second], (t1, t2), _ = two_workers(api, 2)
    claim(api, t1)
    claim(api, t2)
    handoff = api.app.state.handoff
    out: dict[str, Any] = {}
    caller = waiting_call(api, fid, out, b"x")
    assert wait_until(lambda: handoff.watching() == 1)
    # the worker finds the call, runs it and hands its result in
    got: list[dict[str, Any]] = []
    assert wait_until(lambda: bool(got.extend(claim(api, t1, [ok(first, b"1")]).json()["calls"]) or got))
    [handed] = got
    failed = {"id": handed["id"], "ok": False, "result": b64(b"E"), "traceback": "T"}
    assert claim(api, t1, [failed]).status_code == 200
    caller.join(20)
    [c] = out["caller"]["calls"]
    assert c["id"] == handed["id"] == out["caller"]["ids"][0]
    assert (c["state"], c["ok"], c["traceback"]) == ("failed", False, "T")
    assert base64.b64decode(c["result"]) == b"E"
    assert c["output"] == "" and c["output_next"] == 0 and c["error"] is None
    assert handoff.watching() == 0
    # one that times out waiting leaves none either
    r = api.ok("POST", f"{F}/{fid}/calls", json={"calls": [{"args": b64(b"z")}], "wait_s": 0.1})
    assert r["calls"] == [] and handoff.watching() == 0


def test_output_printed_or_a_cancel_answers_the_waiting_submission(api: Api) -> None:
    fid, _, (t1, t2), _ = two_workers(api, 2)
    claim(api, t1)
    claim(api, t2)
    out: dict[str, Any] = {}
    caller = waiting_call(api, fid, out, b"p")
    got: list[dict[str, Any]] = []
    assert wait_until(lambda: bool(got.extend(claim(api, t1).json()["calls"]) or got))
    [handed] = got
    body = {"id": handed["id"], "data": "hello\n", "stream": "stdout"}
    assert api.ok("POST", "/api/v1/worker/output", json=body, headers=bearer(t1))["accepted"]
    caller.join(20)
    [c] = out["caller"]["calls"]  # it printed: the caller has that at once, and polls for the rest
    assert (c["state"], c["output"], c["output_next"], c["result"]) == ("running", "hello\n", 6, None)

    caller = waiting_call(api, fid, out, b"q")
    got.clear()
    assert wait_until(lambda: bool(got.extend(claim(api, t2).json()["calls"]) or got))
    [second] = got
    api.ok("DELETE", f"{F}/{fid}/calls/{second['id']}")
    caller.join(20)
    [c] = out["caller"]["calls"]
    assert c["id"] == second["id"] and c["state"] == "cancelled" and c["result"] is None
    assert api.app.state.handoff.watching() == 0


def test_a_call_ended_on_another_replica_answers_the_submission_by_its_re_check(make_api: Any) -> None:
    a: Api = make_api()
    b: Api = make_api()
    manual(a)
    manual(b)
    node = join(a, "n1", ["3.11"], devices=0)
    fid = register(a, max_workers=1)["id"]
    out: dict[str, Any] = {}
    caller = waiting_call(a, fid, out, b"far", wait_s=4)
    assert wait_until(lambda: a.app.state.handoff.watching() == 1)
    cycle(a)
    [token] = worker_tokens(b, "n1", node).values()
    # the worker talks to replica b: a's submission hears of it only from the database
    got: list[dict[str, Any]] = []
    assert wait_until(lambda: bool(got.extend(claim(b, token).json()["calls"]) or got))
    [handed] = got
    assert claim(b, token, [ok(handed["id"], b"FAR")], max_calls=0).status_code == 200
    caller.join(20)
    [c] = out["caller"]["calls"]
    assert c["state"] == "done" and base64.b64decode(c["result"]) == b"FAR"
    assert a.app.state.handoff.watching() == 0


def test_the_one_worker_of_a_function_is_handed_what_it_asks_for_and_the_rest_waits(api: Api) -> None:
    manual(api)
    node = join(api, "n1", ["3.11"], devices=0)
    fid = register(api, max_workers=1)["id"]
    first = api.ok("POST", f"{F}/{fid}/calls", json={"calls": [{"args": b64(b"0")}]})["ids"]
    cycle(api)
    [token] = worker_tokens(api, "n1", node).values()
    assert [c["id"] for c in claim(api, token, max_calls=4).json()["calls"]] == first
    handoff = api.app.state.handoff
    for asks, sent, handed in ((4, 2, 2), (1, 3, 1)):
        out: dict[str, Any] = {}

        def park(asks: int = asks, out: dict[str, Any] = out) -> None:
            out["worker"] = claim(api, token, max_calls=asks, wait_s=30).json()

        parked = threading.Thread(target=park)
        parked.start()
        assert wait_until(lambda: handoff.parked(fid) == 1)
        body = {"calls": [{"args": b64(b"%d" % i)} for i in range(sent)]}
        ids = api.ok("POST", f"{F}/{fid}/calls", json=body)["ids"]
        parked.join(20)
        assert [c["id"] for c in out["worker"]["calls"]] == ids[:handed]
        state = api.ok("GET", f"{F}/{fid}")
        assert (state["calls_pending"], state["workers_live"]) == (sent - handed, 1)
        assert claim(api, token, [ok(i, b"r") for i in ids[:handed]], max_calls=0).status_code == 200
        if sent > handed:  # what was left over waits for the worker's next claim
            rest = claim(api, token, max_calls=8).json()["calls"]
            assert [c["id"] for c in rest] == ids[handed:]
            assert claim(api, token, [ok(c["id"], b"r") for c in rest], max_calls=0).status_code == 200
