"""Why a whole-GPU request waits, said as a sentence naming the allocations that hold the GPUs;
an agent's -N for a signalled job, stored as the shell's 128+N."""

from __future__ import annotations

from harness import Api
from test_allocations import alloc, cycle, explain, get, join, manual


def test_a_whole_gpu_request_names_the_holders(api: Api) -> None:
    manual(api)
    join(api, "vm", devices=3)
    a = alloc(api, gpus=2)
    b = alloc(api, gpus=1)
    cycle(api)
    assert get(api, a["id"])["state"] == get(api, b["id"])["state"] == "bound"
    c = alloc(api, gpus=2)
    cycle(api)
    assert get(api, c["id"])["state"] == "pending"
    want = f"needs 2 whole idle GPUs on one node; vm: 0 of 3 idle (held by {a['id']}, {b['id']})"
    assert want in explain(api, c["id"])["summary"], explain(api, c["id"])
    assert want in get(api, c["id"])["reason"], get(api, c["id"])
    api.ok("POST", f"/api/v1/allocations/{b['id']}/release")
    cycle(api)
    now = f"needs 2 whole idle GPUs on one node; vm: 1 of 3 idle (held by {a['id']})"
    assert now in get(api, c["id"])["reason"], get(api, c["id"])


def test_a_signal_reported_as_minus_n_is_stored_as_128_plus_n(api: Api) -> None:
    manual(api)
    n = join(api, "sig", devices=0)
    job = alloc(api, cpu_milli=100, command=["sleep", "60"])
    cycle(api)
    body = {"allocation_id": job["id"], "attempt": 1, "state": "failed", "exit_code": -9, "reason": "killed"}
    api.ok("POST", "/api/v1/nodes/sig/reports", headers=n, json={"reports": [body]})
    got = get(api, job["id"])
    assert (got["state"], got["exit_code"]) == ("failed", 137), got
