"""NVLink groups through the control plane: nodes join reporting groups, a multi-GPU allocation
is bound on the node that holds it in one group, and `explain` treats groups as a preference."""

from __future__ import annotations

from harness import Api
from test_allocations import alloc, cycle, explain, get, manual


def join_linked(api: Api, name: str, groups: list[str]) -> None:
    """Join a simulated node whose device i is in NVLink group groups[i] (names as NVML gives them)."""
    token = api.ok("POST", "/api/v1/join-tokens", json={})["token"]
    devices = [
        {
            "index": i,
            "vendor": "simulated",
            "model": "A100",
            "memory_mib": 40960,
            "uuid": f"GPU-{name}-{i}",
            "link_group": g,
        }
        for i, g in enumerate(groups)
    ]
    body = {
        "join_token": token,
        "name": name,
        "cpu_milli": 32000,
        "memory_mib": 65536,
        "labels": {},
        "devices": devices,
    }
    api.ok("POST", "/api/v1/nodes/join", json=body, headers={})


def test_multi_gpu_allocation_goes_where_one_group_holds_it(api: Api) -> None:
    manual(api)
    join_linked(api, "split", ["nvlink-0", "nvlink-0", "nvlink-2", "nvlink-2"])  # joined first
    join_linked(api, "whole", ["nvlink-0"] * 4)
    four = alloc(api, name="four", gpus=4, cpu_milli=1000, memory_mib=1024)
    cycle(api)
    got = get(api, four["id"])
    assert got["state"] == "bound" and got["nodes"] == ["whole"], got
    # a second one fits only across groups: placed there all the same (a preference, not a rule)
    again = alloc(api, name="again", gpus=4, cpu_milli=1000, memory_mib=1024)
    cycle(api)
    got = get(api, again["id"])
    assert got["state"] == "bound" and got["nodes"] == ["split"], got
    assert len({s["device_index"] for s in got["slices"]}) == 4


def test_explain_of_a_waiting_multi_gpu_allocation_does_not_blame_groups(api: Api) -> None:
    manual(api)
    join_linked(api, "split", ["nvlink-0", "nvlink-0", "nvlink-2", "nvlink-2"])
    join_linked(api, "whole", ["nvlink-0"] * 4)
    alloc(api, name="four", gpus=4, cpu_milli=1000, memory_mib=1024)
    alloc(api, name="one", gpus=1, cpu_milli=1000, memory_mib=1024)
    cycle(api)  # `whole` is full, `split` has 3 free over two groups
    waits = alloc(api, name="waits", gpus=4, cpu_milli=1000, memory_mib=1024)
    three = alloc(api, name="three", gpus=3, cpu_milli=1000, memory_mib=1024)
    cycle(api)
    assert get(api, three["id"])["nodes"] == ["split"]  # 2 + 1 over two groups: it does not wait
    ex = explain(api, waits["id"])
    assert ex["state"] == "pending" and "no 4 exclusive idle GPUs" in ex["summary"], ex
    text = str(ex).lower()
    assert "nvlink" not in text and "link" not in text and "group" not in text, ex
