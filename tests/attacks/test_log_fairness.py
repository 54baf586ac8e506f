"""One tenant's jobs printing at full speed cannot hold up another tenant's output on a node.

Each tick of the node's loop sent every job's new output, a few chunks of each stream, before
anything else: B's many jobs flooding their stdout made each tick long, and A's job's last line
(and so its end, reported once its output is all sent) waited behind all of them. A tick now
sends a bounded number of chunks, the tenants taking turns.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.api import AgentApi
from computepool.agent.executor import Executor, JobSpec
from computepool.agent.logship import CHUNKS_PER_TURN, TICK_CHUNKS, LogShipper

FLOOD = "import sys\nsys.stdout.write(('x' * 1023 + '\\n') * 4096)\n"  # 4 MiB


@pytest.fixture
def executor(tmp_path: Path) -> Iterator[Executor]:
    ex = Executor(tmp_path / "agent", cgroup_base=None, kill_grace_s=1.0)
    yield ex
    ex.state.close()


def test_a_tenants_flood_of_output_does_not_hold_up_anothers_last_line(executor: Executor) -> None:
    recs = [executor.start(JobSpec(f"b{i}", 1, [sys.executable, "-c", FLOOD], tenant="b")) for i in range(8)]
    recs.append(executor.start(JobSpec("a1", 1, [sys.executable, "-c", "print('done')"], tenant="a")))
    for rec in recs:
        assert executor.wait(rec.key, 120).state.ended
    sent: list[tuple[str, str]] = []

    def send(allocation_id: int | str, attempt: int, stream: str, offset: int, data: str) -> None:
        sent.append((str(allocation_id), data[:5]))

    shipper = LogShipper(
        AgentApi("http://127.0.0.1:9", timeout_s=1), executor, 64 * 1024, lambda *_: None, send=send
    )
    for rec in recs:  # B's jobs first, as they started first
        shipper.track(executor.get(rec.key) or rec)
    shipper.ship()
    assert sent == []  # nothing before the control plane said its cap (a heartbeat's answer)
    shipper.learn_cap(64)
    shipper.ship()
    assert len(sent) <= TICK_CHUNKS  # a tick is bounded, however much is waiting
    first_of_a = next(i for i, (alloc, _) in enumerate(sent) if alloc == "a1")
    assert first_of_a <= CHUNKS_PER_TURN, sent[:8]  # after one turn of B's at most, not all of B's
    assert "a1#1" not in shipper.tails  # A's output is all sent: its end can go in this tick's report
    while shipper.tails:  # and every byte of B's goes out too, over later ticks
        shipper.ship()
    assert sum(1 for alloc, _ in sent if alloc.startswith("b")) == 8 * 64
