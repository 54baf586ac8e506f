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
