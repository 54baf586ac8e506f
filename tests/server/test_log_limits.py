"""Job logs within bounds: each attempt's stream keeps its last `log_max_mib`, a tenant its newest
`tenant_log_max_mib` over all its allocations, and logs of allocations ended `log_keep_days` ago
go. What was dropped is one line where it was, which readers page through as before."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from harness import Api
from sqlalchemy import func, select
from test_allocations import A, alloc, cycle, get, join, manual

from computepool.server.logic.log_limits import LogLimits
from computepool.store.db import db_now
from computepool.store.logs import marker_text
from computepool.store.models import AllocationLog

MIB = 1 << 20
CHUNK = 256 * 1024  # what an agent sends at once


def chunk(i: int) -> str:
    line = f"line {i:04d} ".ljust(63, "x") + "\n"
    return line * (CHUNK // 64)


class Job:
    """An allocation running on its node, whose output the test writes as that node's agent."""

    def __init__(self, api: Api, nodes: dict[str, dict[str, str]], who: dict[str, str]) -> None:
        self.api, self.who = api, who
        self.id = alloc(api, who, gpus=1, command=["python", "train.py"])["id"]
        cycle(api)
        self.node = get(api, self.id)["nodes"][0]
        self.creds = nodes[self.node]
        self.url = f"{A}/{self.id}/logs"
        self.end = {"stdout": 0, "stderr": 0}

    def write(self, data: str, stream: str = "stdout", offset: int | None = None) -> int:
        body = {"attempt": 1, "stream": stream, "offset": self.end[stream] if offset is None else offset}
        r = self.api.post(self.url, headers=self.creds, json={**body, "data": data})
        assert r.status_code == 200, r.text
        self.end[stream] = int(r.json()["next_offset"])
        return self.end[stream]

    def read_all(self, stream: str = "stdout", offset: int = 0) -> tuple[str, int]:
        out, nxt = "", offset
        while True:
            page = self.api.ok("GET", self.url, headers=self.who, params={stream: nxt})[stream]
            if page["next"] == nxt:
                return out, nxt
            out, nxt = out + page["data"], page["next"]

    def exit(self) -> None:
        report = {"allocation_id": self.id, "attempt": 1, "state": "exited", "exit_code": 0}
        self.api.ok(
            "POST", f"/api/v1/nodes/{self.node}/reports", headers=self.creds, json={"reports": [report]}
        )


def stored(api: Api, alloc_id: int) -> int:
    with api.app.state.db.read() as s:
        stmt = select(func.sum(func.length(AllocationLog.data))).where(
            AllocationLog.allocation_id == alloc_id
        )
        return int(s.execute(stmt).scalar() or 0)


def test_an_attempts_stream_keeps_its_last_bytes_and_says_how_many_went(make_api: Callable[..., Any]) -> None:
    api: Api = make_api(log_max_mib=4)
    manual(api)
    nodes = {"n1": join(api, "n1", devices=2)}
    job = Job(api, nodes, api.admin)
    for i in range(24):  # 6 MiB of stdout
        job.write(chunk(i))
    job.write("err\n", "stderr")
    assert job.end["stdout"] == 6 * MIB
    marker = marker_text(2 * MIB, "stdout")
    assert stored(api, job.id) <= 4 * MIB + len(marker) + len("err\n")
    text, nxt = job.read_all()
    assert nxt == 6 * MIB  # offsets unchanged: a follower goes on where it was
    assert text == marker + "".join(chunk(i) for i in range(8, 24))
    assert job.read_all("stderr") == ("err\n", 4)  # the other stream is its own
    # a reader that had read the first MiB before the drop is told, then reads on
    assert job.read_all(offset=MIB) == (text, 6 * MIB)
    assert job.read_all(offset=3 * MIB)[0] == "".join(chunk(i) for i in range(12, 24))
    # an agent's resent chunk that was dropped meanwhile is not stored again
    assert job.write(chunk(0), offset=0) == 6 * MIB
    job.write(chunk(24))  # more output: the marker grows, the cap holds
    assert job.read_all()[0] == marker_text(2 * MIB + CHUNK, "stdout") + "".join(
        chunk(i) for i in range(9, 25)
    )
    assert stored(api, job.id) <= 4 * MIB + len(marker) + len("err\n")


def test_a_tenant_over_its_total_loses_its_oldest_output_and_old_logs_go(
    make_api: Callable[..., Any],
) -> None:
    api: Api = make_api(log_max_mib=8, tenant_log_max_mib=4, log_keep_days=30)
    manual(api)
    nodes = {"n1": join(api, "n1", devices=4), "n2": join(api, "n2", devices=4)}
    api.tenant("acme")
    api.tenant("other")
    acme, other = api.user("alice", "acme", "member"), api.user("olga", "other", "member")
    old, new, theirs = Job(api, nodes, acme), Job(api, nodes, acme), Job(api, nodes, other)
    for job in (old, new, theirs):
        for i in range(12):  # 3 MiB each: acme holds 6 MiB, 2 over its cap
            job.write(chunk(i))
    limits = LogLimits(api.app.state.db, api.settings)
    with api.app.state.db.read() as s:
        now = db_now(s)
    report = limits.run_once(now)
    assert report.dropped == {"acme": 2 * MIB} and report.expired == 0
    assert old.read_all()[0] == marker_text(2 * MIB, "stdout") + "".join(chunk(i) for i in range(8, 12))
    assert new.read_all()[0] == theirs.read_all()[0] == "".join(chunk(i) for i in range(12))
    assert limits.run_once(now).dropped == {}  # within its cap now
    # retention: an ended allocation's logs go once it ended longer ago than log_keep_days
    old.exit()
    ended = get(api, old.id)["ended_at"]
    assert ended
    assert limits.run_once(now + timedelta(days=29)).expired == 0
    assert old.read_all()[0].startswith("[cpool:")
    assert limits.run_once(now + timedelta(days=31)).expired == 1
    assert old.read_all() == ("", 0) and stored(api, old.id) == 0
    assert new.read_all()[1] == theirs.read_all()[1] == 3 * MIB  # live ones keep theirs
    assert limits.run_once(now + timedelta(days=31)).expired == 0
