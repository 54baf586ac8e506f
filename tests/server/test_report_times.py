"""A skewed agent clock cannot move a job's start outside what the control plane saw: a start
reported before the bind is stored as the bind, one in the future as the report's arrival, one in
between as reported (plain jobs and gang members alike)."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from harness import Api
from test_allocations import alloc, cycle, get, join, manual
from test_allocations_agent import report


def _t(text: str) -> datetime:
    return datetime.fromisoformat(text)


@pytest.mark.parametrize("skew_s", [-600.0, 600.0, None])
def test_a_reported_start_lies_between_the_bind_and_its_arrival(api: Api, skew_s: float | None) -> None:
    manual(api)
    n1 = join(api, "n1", devices=1)
    job = alloc(api, gpus=1, command=["true"])
    cycle(api)
    bound = _t(get(api, job["id"])["bound_at"])
    claimed = bound + timedelta(seconds=skew_s) if skew_s is not None else bound
    if skew_s is None:  # a true clock: a moment after the bind, kept as the agent said
        claimed = bound + timedelta(microseconds=1)
    before_report = datetime.now(bound.tzinfo)
    body = {"allocation_id": job["id"], "attempt": 1, "state": "running", "started_at": claimed.isoformat()}
    assert report(api, "n1", n1, body)["accepted"] == [job["id"]]
    started = _t(get(api, job["id"])["started_at"])
    assert started >= bound
    if skew_s is None:
        assert started == claimed
    elif skew_s < 0:
        assert started == bound  # not ten minutes before the pool bound it
    else:
        assert started <= before_report + timedelta(seconds=60)  # not ten minutes ahead


def test_a_gang_members_start_is_kept_within_the_bind_too(api: Api) -> None:
    manual(api)
    heads = {n: join(api, n, devices=1) for n in ("n1", "n2")}
    gang = alloc(api, gpus=1, gang_nodes=2, command=["true"])
    cycle(api)
    bound = _t(get(api, gang["id"])["bound_at"])
    early = (bound - timedelta(minutes=10)).isoformat()
    for n, h in heads.items():
        body = {"allocation_id": gang["id"], "attempt": 1, "state": "running", "started_at": early}
        assert report(api, n, h, body)["accepted"] == [gang["id"]]
    g = get(api, gang["id"])
    assert g["state"] == "active" and _t(g["started_at"]) == bound
