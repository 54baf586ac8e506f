"""A GPU's mps slices belong to one tenant at a time, in the live pool as in the scheduler.

MPS runs one Unix user's server per GPU and every job runs as its tenant's user, so two
tenants' mps slices on one device would take turns instead of sharing it.
"""

from __future__ import annotations

from harness import Api
from test_allocations import A, alloc, cycle, explain, get, join, manual

BLOCKED = "device 0 holds another tenant's mps slices"


def test_mps_slices_of_one_gpu_stay_with_one_tenant(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=1)
    for t in ("a", "b"):
        api.tenant(t)
    ua = api.user("ua", "a", "member")
    ub = api.user("ub", "b", "member")
    first = alloc(api, ua, gpus=1, gpu_milli=300, isolation="mps")
    cycle(api)
    assert get(api, first["id"])["state"] == "bound"
    theirs = alloc(api, ub, gpus=1, gpu_milli=300, isolation="mps")
    second = alloc(api, ua, gpus=1, gpu_milli=300, isolation="mps")
    cycle(api)
    s = get(api, second["id"])
    assert s["state"] == "bound" and s["slices"][0]["device_index"] == 0
    assert s["slices"][0]["isolation"] == "mps"
    b = get(api, theirs["id"], ub)
    assert b["state"] == "pending" and BLOCKED in b["reason"], b["reason"]
    ex = explain(api, theirs["id"], ub)
    assert ex["reasons"]["counts"] == {BLOCKED: 1} and BLOCKED in ex["summary"]
    # time-sliced work of b is refused for the tier, not the tenant
    ts = alloc(api, ub, gpus=1, gpu_milli=100)
    cycle(api)
    assert explain(api, ts["id"], ub)["reasons"]["counts"] == {"device 0 holds mps slices": 1}
    api.ok("POST", f"{A}/{ts['id']}/cancel")
    # the device is b's to take once a's last mps slice is gone, and then it is b's alone
    api.ok("POST", f"{A}/{first['id']}/release")
    cycle(api)
    assert get(api, theirs["id"])["state"] == "pending"
    api.ok("POST", f"{A}/{second['id']}/release")
    cycle(api)
    assert get(api, theirs["id"])["state"] == "bound"
    again = alloc(api, ua, gpus=1, gpu_milli=300, isolation="mps")
    cycle(api)
    assert BLOCKED in get(api, again["id"])["reason"]
