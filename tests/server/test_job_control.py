"""Job arrays (one allocation per index, a limit on members at once), dependencies (`after`) and
retries after the job's own failure, through the API, the scheduling cycle and agent reports."""

from __future__ import annotations

import time
from typing import Any

from harness import Api
from test_allocations import A, alloc, cycle, get, join, manual
from test_allocations_agent import report


def members(api: Api, array_id: int) -> list[dict[str, Any]]:
    items = api.ok("GET", A, params={"array": array_id})["items"]
    return sorted(items, key=lambda a: int(a["array_index"]))


def end(api: Api, node: str, cred: dict[str, str], a: dict[str, Any], code: int) -> None:
    report(api, node, cred, {"allocation_id": a["id"], "attempt": a["attempt"], "state": "running"})
    rep = {"allocation_id": a["id"], "attempt": a["attempt"], "state": "exited", "exit_code": code}
    report(api, node, cred, rep)


def bound_after_backoff(api: Api, alloc_id: int) -> dict[str, Any]:
    """Cycles until the retry's back-off (1 s, then 2 s …) has passed and it is bound again."""
    deadline = time.monotonic() + 30
    while (a := get(api, alloc_id))["state"] == "pending":
        assert "retry" in a["reason"], a["reason"]
        assert time.monotonic() < deadline, a
        time.sleep(0.1)
        cycle(api)
    return a


def test_array_limit_env_and_cancel(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=4)
    head = alloc(api, gpus=1, command=["python3", "task.py"], array="0-20:5%2")
    assert head["array_id"] == head["id"] and head["array_index"] == 0
    assert head["env"]["CPOOL_ARRAY_INDEX"] == "0" and head["env"]["CPOOL_ARRAY_COUNT"] == "5"
    cycle(api)
    got = members(api, head["id"])
    assert [m["array_index"] for m in got] == [0, 5, 10, 15, 20]
    assert [m["state"] for m in got] == ["bound", "bound", "pending", "pending", "pending"]
    assert got[2]["reason"] == f"array {head['id']}: 2 of its members run (limit %2)"
    assert api.ok("GET", f"{A}/{got[2]['id']}/explain")["summary"] == got[2]["reason"]
    assert got[3]["env"]["CPOOL_ARRAY_INDEX"] == "15" and got[3]["env"]["CPOOL_ARRAY_ID"] == str(head["id"])
    api.ok("POST", f"{A}/{got[0]['id']}/release")
    cycle(api)
    assert [get(api, m["id"])["state"] for m in got[1:4]] == ["bound", "bound", "pending"]
    for m in got:  # the CLI cancels an array member by member
        if get(api, m["id"])["state"] in ("pending", "bound", "active"):
            api.ok("POST", f"{A}/{m['id']}/cancel")
    assert {m["state"] for m in members(api, head["id"])} <= {"released", "cancelled"}


def test_array_bad_specs_name_the_field(api: Api) -> None:
    for spec in ("9-1", "0-3%0", "a-b", "1,1", "0-99999", "3:2"):
        r = api.post(A, json={"command": ["true"], "array": spec}, headers=api.admin)
        assert r.status_code == 422 and "array" in r.text, (spec, r.text)
    r = api.post(A, json={"gpus": 1, "array": "0-3"}, headers=api.admin)
    assert r.status_code == 422 and "array" in r.text


def test_after_ok_waits_then_starts(api: Api) -> None:
    manual(api)
    cred = join(api, "n1", devices=2)
    first = alloc(api, gpus=1, command=["true"])
    then = alloc(api, gpus=1, command=["true"], after=[{"id": first["id"]}])
    assert then["after"] == [{"id": first["id"], "on": "ok"}]
    cycle(api)
    assert get(api, then["id"])["reason"] == f"waits for {first['id']} to end ok (now pending)"
    cycle(api)  # the next cycle sees it bound
    first = get(api, first["id"])
    assert first["state"] == "bound" and get(api, then["id"])["state"] == "pending"
    assert get(api, then["id"])["reason"] == f"waits for {first['id']} to end ok (now bound)"
    end(api, "n1", cred, first, 0)
    cycle(api)
    assert get(api, then["id"])["state"] == "bound"


def test_after_never_met_ends_unstarted(api: Api) -> None:
    manual(api)
    cred = join(api, "n1", devices=2)
    first = alloc(api, gpus=1, command=["false"])
    ok = alloc(api, gpus=1, command=["true"], after=[{"id": first["id"], "on": "ok"}])
    on_fail = alloc(api, gpus=1, command=["true"], after=[{"id": first["id"], "on": "failed"}])
    cycle(api)
    end(api, "n1", cred, get(api, first["id"]), 3)
    cycle(api)
    done = get(api, ok["id"])
    assert done["state"] == "failed" and done["started_at"] is None
    assert done["reason"] == f"dependency never met: {first['id']} ended failed, ok was needed"
    assert get(api, on_fail["id"])["state"] == "bound"
    # a cancelled dependency never ends ok either; `any` takes every end
    gone = alloc(api, gpus=1, command=["true"])
    api.ok("POST", f"{A}/{gone['id']}/cancel")
    never = alloc(api, gpus=1, command=["true"], after=[{"id": gone["id"]}])
    anyway = alloc(api, gpus=1, command=["true"], after=[{"id": gone["id"], "on": "any"}])
    cycle(api)
    assert get(api, never["id"])["state"] == "failed"
    assert get(api, anyway["id"])["state"] == "bound"


def test_retries_stop_on_success_and_at_the_limit(api: Api) -> None:
    manual(api)
    cred = join(api, "n1", devices=1)
    job = alloc(api, gpus=1, command=["flaky"], retries=2)
    cycle(api)
    a = get(api, job["id"])
    for attempt in (1, 2):
        assert a["state"] == "bound" and a["attempt"] == attempt
        end(api, "n1", cred, a, 1)
        a = get(api, job["id"])
        assert a["state"] == "pending" and a["attempt"] == attempt + 1
        assert f"retry {attempt} of 2 as attempt {attempt + 1}" in a["reason"]
        cycle(api)
        assert get(api, job["id"])["reason"].startswith(f"retry {attempt} of 2: back-off until")
        a = bound_after_backoff(api, job["id"])
    end(api, "n1", cred, a, 1)
    last = get(api, job["id"])
    assert last["state"] == "failed" and last["attempt"] == 3 and last["exit_code"] == 1
    assert last["retries"] == 2
    # success ends it at once
    ok = alloc(api, gpus=1, command=["fine"], retries=3)
    cycle(api)
    end(api, "n1", cred, get(api, ok["id"]), 0)
    assert get(api, ok["id"])["state"] == "released" and get(api, ok["id"])["attempt"] == 1


def test_retry_on_exit_filters_codes(api: Api) -> None:
    manual(api)
    cred = join(api, "n1", devices=1)
    job = alloc(api, gpus=1, command=["x"], retries=3, retry_on_exit=[137])
    cycle(api)
    end(api, "n1", cred, get(api, job["id"]), 137)
    assert get(api, job["id"])["state"] == "pending"
    end(api, "n1", cred, bound_after_backoff(api, job["id"]), 2)
    a = get(api, job["id"])
    assert a["state"] == "failed" and a["attempt"] == 2 and a["exit_code"] == 2
    r = api.post(A, json={"command": ["x"], "retry_on_exit": [1]}, headers=api.admin)
    assert r.status_code == 422 and "retry_on_exit" in r.text


def test_another_tenants_array_lists_nothing_and_its_limit_is_its_own(api: Api) -> None:
    """Listing a victim's array shows nothing; an attacker's members never count against its limit."""
    manual(api)
    join(api, "n1", devices=4)
    api.tenant("acme")
    mallory = api.user("mallory", "acme", "member")
    victim = alloc(api, gpus=1, command=["v"], array="0-1%1")
    assert api.ok("GET", A, headers=mallory, params={"array": victim["id"]})["items"] == []
    mine = alloc(api, mallory, gpus=1, command=["m"], array="0-1")
    assert mine["array_id"] == mine["id"] != victim["id"]
    cycle(api)
    assert get(api, victim["id"])["state"] == "bound"
    names = api.ok("GET", A, params={"array": victim["id"]})["items"]
    assert sorted(a["state"] for a in names) == ["bound", "pending"]
    r = api.post(A, json={"command": ["true"], "env": {"CPOOL_ARRAY_INDEX": "7"}}, headers=mallory)
    assert r.status_code == 422 and "CPOOL_ARRAY_INDEX" in r.text
