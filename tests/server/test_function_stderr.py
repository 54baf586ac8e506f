"""A call's stderr is kept apart from its stdout: stored in its own column, read from its own offset,
so the caller can write each to its own stream."""

from __future__ import annotations

import base64

from harness import Api
from test_allocations import cycle, manual
from test_functions_api import bearer, join, next_call, register, results, submit, worker_tokens

F = "/api/v1/functions"


def test_stderr_is_kept_apart_and_read_from_its_own_offset(api: Api) -> None:
    manual(api)
    n1 = join(api, "n1", ["3.11"], devices=0)
    fid = register(api, max_workers=1)["id"]
    [cid] = submit(api, fid, b"x")
    cycle(api)
    [token] = worker_tokens(api, "n1", n1).values()
    assert next_call(api, token).json()["call"]["id"] == cid

    def out(data: str, stream: str | None = None) -> None:
        body = {"id": cid, "data": data} | ({"stream": stream} if stream else {})
        assert api.post("/api/v1/worker/output", json=body, headers=bearer(token)).json() == {
            "accepted": True
        }

    out("OUT1\n")
    out("ERR1\n", "stderr")
    out("OUT2\n", "stdout")
    [c] = results(api, fid, [cid])
    assert (c["output"], c["output_next"], c["stderr"], c["stderr_next"]) == ("OUT1\nOUT2\n", 10, "ERR1\n", 5)
    # stderr alone is news for a caller that read all of stdout
    out("ERR2\n", "stderr")
    [c] = results(api, fid, [cid], output_from={str(cid): 10}, stderr_from={str(cid): 5})
    assert (c["output"], c["stderr"], c["stderr_next"]) == ("", "ERR2\n", 10)
    assert results(api, fid, [cid], output_from={str(cid): 10}, stderr_from={str(cid): 10}) == []

    r = api.post(
        "/api/v1/worker/output", json={"id": cid, "data": "x", "stream": "tty"}, headers=bearer(token)
    )
    assert r.status_code == 422 and r.json()["field"] == "stream", r.text
    r = api.post(f"{F}/{fid}/results", json={"ids": [cid], "stderr_from": {str(cid): -1}}, headers=api.admin)
    assert r.status_code == 422 and r.json()["field"] == f"stderr_from.{cid}", r.text

    next_call(api, token, {"id": cid, "ok": True, "result": base64.b64encode(b"1").decode()})
    [c] = results(api, fid, [cid])
    assert c["state"] == "done" and c["output"] == "OUT1\nOUT2\n" and c["stderr"] == "ERR1\nERR2\n"


def test_a_nul_printed_or_raised_is_kept_as_a_replacement_character(api: Api) -> None:
    """PostgreSQL text holds no NUL: output and tracebacks carrying one used to answer 500 there."""
    manual(api)
    n1 = join(api, "n1", ["3.11"], devices=0)
    fid = register(api, max_workers=1)["id"]
    [cid] = submit(api, fid, b"x")
    cycle(api)
    [token] = worker_tokens(api, "n1", n1).values()
    assert next_call(api, token).json()["call"]["id"] == cid
    for stream in ("stdout", "stderr"):
        r = api.post(
            "/api/v1/worker/output",
            json={"id": cid, "data": "a\x00b", "stream": stream},
            headers=bearer(token),
        )
        assert r.status_code == 200 and r.json() == {"accepted": True}, r.text
    done = {"id": cid, "ok": False, "result": base64.b64encode(b"e").decode(), "traceback": "x\x00y"}
    assert next_call(api, token, done).status_code == 200
    [c] = results(api, fid, [cid])
    assert (c["output"], c["stderr"], c["traceback"]) == ("a\ufffdb", "a\ufffdb", "x\ufffdy")
    assert c["output_next"] == 3  # one character for one: the offsets callers read by still hold


def test_a_log_chunk_with_a_nul_is_refused_naming_the_field(api: Api) -> None:
    manual(api)
    node = join(api, "n1", None, devices=0)
    alloc = api.ok("POST", "/api/v1/allocations", json={"cpu_milli": 100, "command": ["true"]})
    cycle(api)
    r = api.post(
        f"/api/v1/allocations/{alloc['id']}/logs",
        json={"attempt": 1, "stream": "stdout", "offset": 0, "data": "a\x00b"},
        headers=node,
    )
    assert r.status_code == 422 and r.json()["field"] == "data", r.text


def test_one_answer_carries_results_up_to_a_budget_and_the_rest_comes_next(api: Api, db_url: str) -> None:
    """A thousand large results are never read (nor sent) at once: the lowest ids that fit the
    budget come first, at least one, and the caller asks again for the rest."""
    from computepool.store import functions as store
    from computepool.store.db import Database

    manual(api)
    n1 = join(api, "n1", ["3.11"], devices=0)
    fid = register(api, max_workers=1, keep_warm_s=60)["id"]
    ids = submit(api, fid, b"a", b"b", b"c")
    cycle(api)
    [token] = worker_tokens(api, "n1", n1).values()
    got = next_call(api, token).json()["call"]
    for i in range(3):
        done = {"id": got["id"], "ok": True, "result": base64.b64encode(bytes(3000)).decode()}  # 4,000 chars
        got = next_call(api, token, done).json()["call"]
        assert (got is None) == (i == 2)
    db = Database(db_url)
    try:
        with db.read() as s:
            assert [r.id for r in store.results(s, fid, ids, budget=9000)] == ids[:2]
            assert [r.id for r in store.results(s, fid, ids, budget=100)] == ids[:1]  # at least one
            assert [r.id for r in store.results(s, fid, ids[2:], budget=9000)] == ids[2:]
            assert len(store.results(s, fid, ids)) == 3
    finally:
        db.dispose()
    assert [c["id"] for c in results(api, fid, ids)] == ids  # the server's budget holds them all


def test_output_already_read_costs_the_budget_nothing(api: Api, db_url: str) -> None:
    """A running call that printed a lot, all of it read, must not hold back a call that ended."""
    from computepool.store import functions as store
    from computepool.store.db import Database

    manual(api)
    n1 = join(api, "n1", ["3.11"], devices=0)
    fid = register(api, max_workers=2, keep_warm_s=60)["id"]
    a, b = submit(api, fid, b"a", b"b")
    cycle(api)
    (ta, tb) = worker_tokens(api, "n1", n1).values()
    assert next_call(api, ta).json()["call"]["id"] == a
    assert next_call(api, tb).json()["call"]["id"] == b
    out = api.post("/api/v1/worker/output", json={"id": a, "data": "x" * 1000}, headers=bearer(ta))
    assert out.status_code == 200, out.text
    next_call(api, tb, {"id": b, "ok": True, "result": base64.b64encode(b"B").decode()})
    db = Database(db_url)
    try:
        with db.read() as s:
            fresh = store.results(s, fid, [a, b], with_news=True, budget=500)
            seen = store.results(s, fid, [a, b], with_news=True, budget=500, read={a: (1000, 0)})
    finally:
        db.dispose()
    assert [r.id for r in fresh] == [a]  # its 1,000 unread characters fill the answer
    assert [r.id for r in seen] == [b]  # read already: the ended call comes
