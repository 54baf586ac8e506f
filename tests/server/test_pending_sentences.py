"""Why a whole-GPU request waits, said as a sentence naming the allocations that hold the GPUs."""

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
