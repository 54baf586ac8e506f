"""Philly replay with queues: loader, quota/preemption logic, simulator, CLI."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from computepool.cli.sim_replay import register
from computepool.core.errors import InvalidInput
from computepool.scheduler.queueing import (
    Claim,
    Holding,
    Quota,
    QuotaLedger,
    proportional_guarantees,
    select_victims,
)
from computepool.sim.philly import (
    JobTrace,
    VirtualCluster,
    load_jobs,
    load_published,
    load_trace,
    load_vcs,
)
from computepool.sim.replay import ReplayResult, calibrate, find_parity, replay

REPO = Path(__file__).resolve().parents[1]
TRACES = Path(os.environ.get("CPOOL_TRACES", REPO.parent / "shared" / "traces"))
PHILLY = TRACES / "philly"
needs_trace = pytest.mark.skipif(
    not (PHILLY / "philly_jobs.csv").exists(), reason="Philly trace not available"
)


@pytest.fixture(scope="module")
def trace() -> JobTrace:
    if not (PHILLY / "philly_jobs.csv").exists():
        pytest.skip("Philly trace not available")
    return load_trace(PHILLY / "philly_jobs.csv", PHILLY / "philly_vc.csv")


# -- loader ----------------------------------------------------------------------------------


@needs_trace
def test_loader_real_files(trace: JobTrace) -> None:
    assert len(trace.vcs) == 11
    assert trace.total_gpus == 2816
    assert len(trace) == 68503
    assert set(np.unique(trace.vc).tolist()) == set(range(11))
    assert trace.submit.min() >= 0
    assert trace.submit.max() < 61 * 86400  # October + November
    assert np.all(np.diff(trace.submit) >= 0)
    assert trace.gpus.min() >= 1 and trace.duration.min() >= 0
    pub = load_published(PHILLY / "helios_static_vc_published.csv")
    assert pub["all"].queue_avg_s == 56531 and pub["all"].jct_avg_s == 86072
    assert {v.name for v in trace.vcs} <= set(pub)


def _write(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "jobs.csv"
    p.write_text(body)
    return p


VCS = (VirtualCluster("a", 1),)
HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"
GOOD = "2017-10-02 00:00:00,10.0,1,10.0,a\n"


@pytest.mark.parametrize(
    ("body", "line", "words"),
    [
        ("timestamp,duration,num_gpus,cluster\n" + "2017-10-02 00:00:00,1,1,a\n", 1, "gpu_time"),
        (HEADER + GOOD + "2017-10-02 00:00:00,-5.0,1,5.0,a\n", 3, "duration"),
        (HEADER + GOOD + "2017-10-0x 00:00:00,5.0,1,5.0,a\n", 3, "timestamp"),
        (HEADER + GOOD + "2017-10-02 00:00:00,5.0,0,5.0,a\n", 3, "num_gpus"),
        (HEADER + GOOD + "2017-10-02 00:00:00,5.0,1,abc,a\n", 3, "gpu_time"),
        (HEADER + GOOD + "2017-10-02 00:00:00,5.0,1\n", 3, "fields"),
    ],
)
def test_malformed_jobs_name_file_and_line(tmp_path: Path, body: str, line: int, words: str) -> None:
    p = _write(tmp_path, body)
    with pytest.raises(InvalidInput) as e:
        load_jobs(p, VCS)
    assert e.value.where == f"{p}:{line}"
    assert words in str(e.value)


def test_malformed_vcs(tmp_path: Path) -> None:
    p = tmp_path / "vc.csv"
    p.write_text("vc,node num\na,4\nb,-1\n")
    with pytest.raises(InvalidInput) as e:
        load_vcs(p)
    assert e.value.where == f"{p}:3"
    p.write_text("vc,nodes\na,4\n")
    with pytest.raises(InvalidInput, match="node num"):
        load_vcs(p)


def test_loader_window_and_vc_filter(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        HEADER
        + "2017-09-30 23:59:59,1,1,1,a\n"  # before the window
        + "2017-10-01 00:00:00,2,1,2,a\n"
        + "2017-11-30 23:59:59,3,2,6,a\n"
        + "2017-12-01 00:00:00,4,1,4,a\n"  # after
        + "2017-10-05 00:00:00,5,1,5,zz\n",  # unknown VC
    )
    t = load_jobs(p, VCS)
    assert t.duration.tolist() == [2.0, 3.0]
    assert t.submit.tolist() == [0.0, 61 * 86400 - 1]


# -- quota and victim selection ----------------------------------------------------------------


def test_ledger_borrowing_and_order() -> None:
    led = QuotaLedger({"a": Quota(8), "b": Quota(8, limit=12)})
    led.allocate("b", 8)
    assert led.within_guarantee("a", 8) and led.is_borrowing("b", 1)
    assert led.can_admit("b", 4) and not led.can_admit("b", 5)
    led.allocate("b", 4)
    assert led.borrowed("b") == 4 and led.reclaimable() == {"b": 4}
    assert led.order({"a": 1, "b": 1}) == ["a", "b"]
    led.release("b", 12)
    assert led.reclaimable() == {}


def test_proportional_guarantees_sum_to_capacity() -> None:
    g = proportional_guarantees({"a": 512, "b": 256, "c": 64}, 500)
    assert sum(g.values()) == 500
    assert g["a"] > g["b"] > g["c"]
    assert proportional_guarantees({"a": 8}, 16) == {"a": 8}


def test_victims_lose_least_work_and_only_what_is_needed() -> None:
    old = Holding(1, "b", ((0, 4),), started_at=0.0)
    young1 = Holding(2, "b", ((1, 2),), started_at=95.0)
    young2 = Holding(3, "b", ((1, 2),), started_at=90.0)
    free = [4, 4]
    plan = select_victims(Claim("a", 8), free, [old, young1, young2], {"b": 8}, now=100.0)
    assert plan is not None
    assert plan.nodes == (1,)
    assert {h.job for h in plan.victims} == {2, 3}
    assert plan.lost_gpu_s == pytest.approx(2 * 5 + 2 * 10)
    # Needing 6 on node 1, the youngest alone suffices.
    plan = select_victims(Claim("a", 6), free, [old, young1, young2], {"b": 8}, now=100.0)
    assert plan is not None and [h.job for h in plan.victims] == [2]
    # The guarantee is never taken: no budget, no victims.
    assert select_victims(Claim("a", 8), free, [old, young1, young2], {}, now=100.0) is None
    # Own jobs are never victims.
    assert select_victims(Claim("b", 8), free, [old, young1], {"b": 8}, now=100.0) is None


def test_victims_for_whole_node_gang() -> None:
    hs = [Holding(i, "b", ((i, 8),), started_at=float(i)) for i in range(3)]
    plan = select_victims(Claim("a", 8, nodes=2), [0, 0, 0], hs, {"b": 24}, now=10.0)
    assert plan is not None
    assert sorted(plan.nodes) == [1, 2]  # the two youngest
    assert plan.lost_gpu_s == pytest.approx(8 * 9 + 8 * 8)


# -- simulator, hand-computed ----------------------------------------------------------------


def test_static_fifo_head_of_line_blocking() -> None:
    t = JobTrace.from_jobs(
        [VirtualCluster("a", 1)],
        [(0, 10, 6, "a"), (1, 5, 4, "a"), (2, 1, 1, "a")],
    )
    r = replay(t, "static")
    # j1 needs 4 but only 2 are free until t=10; j2 (1 GPU) would fit but waits behind j1.
    assert r.start.tolist() == [0, 10, 10]
    assert r.finish.tolist() == [10, 15, 11]
    assert r.overall.avg_queue_s == pytest.approx((0 + 9 + 8) / 3)
    assert r.overall.avg_jct_s == pytest.approx((10 + 14 + 9) / 3)


def test_gang_takes_whole_nodes_and_oversize_is_unplaceable() -> None:
    t = JobTrace.from_jobs(
        [VirtualCluster("a", 3)],
        [(0, 10, 1, "a"), (0, 5, 16, "a"), (1, 1, 12, "a"), (2, 1, 32, "a")],
    )
    r = replay(t, "static", record=True)
    runs = {run.job: run for run in r.runs}
    assert runs[0].nodes == (0,)
    assert runs[1].nodes == (1, 2) and runs[1].gpus_per_node == 8
    # 12 GPUs need 2 whole nodes: only free once the 16-GPU gang ends at t=5.
    assert r.start[2] == 5 and runs[2].nodes == (1, 2)
    assert r.overall.unplaceable == 1 and np.isnan(r.start[3])
    assert r.overall.jobs == 3


def test_consolidate_picks_fullest_node() -> None:
    t = JobTrace.from_jobs(
        [VirtualCluster("a", 3)],
        [(0, 100, 4, "a"), (0, 100, 6, "a"), (1, 10, 2, "a"), (2, 10, 3, "a")],
    )
    runs = {run.job: run.nodes for run in replay(t, "static", record=True).runs}
    assert runs[0] == (0,) and runs[1] == (1,)
    assert runs[2] == (1,)  # 2 free on node 1 is the tightest fit
    assert runs[3] == (0,)  # 4 free on node 0 beats the empty node 2


def test_pooled_borrow_then_reclaim_youngest() -> None:
    vcs = [VirtualCluster("a", 1), VirtualCluster("b", 1)]
    t = JobTrace.from_jobs(
        vcs,
        [(0, 100, 8, "b"), (5, 100, 8, "b"), (10, 10, 8, "a")],
    )
    s = replay(t, "static")
    assert s.start.tolist() == [0, 100, 10]  # b's second job waits for b's only node
    r = replay(t, "pooled", record=True)
    # b borrows a's idle node at t=5; a reclaims it at t=10 from the youngest borrowed job.
    assert r.start.tolist() == [0, 20, 10]
    assert r.preemptions.tolist() == [0, 1, 0]
    assert r.overall.preemptions == 1
    assert r.overall.lost_gpu_hours == pytest.approx(8 * 5 / 3600)
    useful = 8 * 100 + 8 * 100 + 8 * 10
    assert r.overall.lost_work_pct == pytest.approx(100 * 40 / useful)
    assert r.per_partition[1].preemptions == 1 and r.per_partition[0].preemptions == 0
    assert r.finish.tolist() == [100, 120, 20]
    lost = [run for run in r.runs if run.preempted]
    assert len(lost) == 1 and (lost[0].job, lost[0].start, lost[0].end) == (1, 5, 10)
    assert r.overall.avg_queue_s < s.overall.avg_queue_s


def test_pooled_does_not_preempt_guaranteed_work() -> None:
    vcs = [VirtualCluster("a", 1), VirtualCluster("b", 1)]
    # b holds exactly its guarantee; a (also at its guarantee) wants more: it waits.
    t = JobTrace.from_jobs(vcs, [(0, 100, 8, "b"), (0, 50, 8, "a"), (1, 10, 1, "a")])
    r = replay(t, "pooled")
    assert r.overall.preemptions == 0
    assert r.start.tolist() == [0, 0, 50]


def test_pooled_scales_guarantees_and_rejects_oversize() -> None:
    vcs = [VirtualCluster("a", 2), VirtualCluster("b", 2)]
    t = JobTrace.from_jobs(vcs, [(0, 1, 16, "a"), (0, 1, 24, "b")])
    r = replay(t, "pooled", nodes=2)
    assert r.nodes == 2 and r.gpus == 16
    assert r.overall.unplaceable == 1 and r.overall.jobs == 1


# -- invariants on random workloads ------------------------------------------------------------


def _check_invariants(t: JobTrace, r: ReplayResult, node_count: int) -> None:
    # Every placeable job finishes exactly once, after its last start, for its full duration.
    done = Counter(run.job for run in r.runs if not run.preempted)
    placeable = ~np.isnan(r.finish)
    assert set(done) == set(np.flatnonzero(placeable).tolist())
    assert all(c == 1 for c in done.values())
    ok = placeable
    assert np.allclose(r.finish[ok] - r.start[ok], t.duration[ok])
    assert np.all(r.start[ok] >= t.submit[ok])
    # GPUs in use on each node never exceed 8 (sweep over run boundaries).
    events: list[tuple[float, int, int, int]] = []
    for run in r.runs:
        assert len(set(run.nodes)) == len(run.nodes) and run.gpus_per_node <= 8
        if run.end == run.start:
            continue  # holds no GPU-time; the instant's order is the simulator's own
        for n in run.nodes:
            events.append((run.start, 1, n, run.gpus_per_node))
            events.append((run.end, 0, n, -run.gpus_per_node))  # ends free before starts
    used = [0] * node_count
    for _, _, n, g in sorted(events):
        used[n] += g
        assert 0 <= used[n] <= 8


jobs_strategy = st.lists(
    st.tuples(
        st.integers(0, 50),
        st.integers(0, 30),
        st.sampled_from([1, 1, 2, 3, 4, 8, 12, 16]),
        st.sampled_from(["a", "b", "c"]),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(jobs=jobs_strategy, sizes=st.tuples(*[st.integers(1, 2)] * 3), pool=st.integers(1, 6))
def test_replay_invariants(
    jobs: list[tuple[int, int, int, str]], sizes: tuple[int, int, int], pool: int
) -> None:
    vcs = [VirtualCluster(n, s) for n, s in zip("abc", sizes, strict=True)]
    t = JobTrace.from_jobs(vcs, [(float(a), float(d), g, v) for a, d, g, v in jobs])
    s = replay(t, "static", record=True)
    _check_invariants(t, s, sum(sizes))
    p = replay(t, "pooled", nodes=pool, record=True)
    _check_invariants(t, p, pool)
    lost = sum(r.gpus_per_node * len(r.nodes) * (r.end - r.start) for r in p.runs if r.preempted)
    assert p.overall.lost_gpu_hours == pytest.approx(lost / 3600)
    assert p.overall.preemptions == sum(r.preempted for r in p.runs)


# -- real trace ------------------------------------------------------------------------------


@needs_trace
def test_static_scale_one_on_real_trace(trace: JobTrace) -> None:
    r = replay(trace, "static")
    assert r.overall.jobs == len(trace) and r.overall.unplaceable == 0
    assert 50 < r.overall.avg_queue_s < 200  # light load at the recorded durations


@pytest.mark.slow
@needs_trace
def test_calibrate_and_parity_on_real_trace(trace: JobTrace) -> None:
    cal = calibrate(trace)
    assert abs(cal.result.overall.avg_queue_s / 56531 - 1) < 0.01
    pooled = replay(trace, "pooled", cal.duration_scale)
    assert pooled.overall.avg_queue_s <= cal.result.overall.avg_queue_s / 100
    par = find_parity(trace, cal.duration_scale, static=cal.result)
    assert par.nodes is not None and par.gpus_saved_pct >= 40
    assert par.pooled is not None and par.pooled.overall.lost_work_pct <= 2


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.command()
    def other() -> None:  # a second command keeps `replay` a named subcommand
        """Placeholder."""

    return app


@needs_trace
def test_cli_json_on_real_trace() -> None:
    runner = CliRunner()
    args = [
        "replay",
        "--jobs",
        str(PHILLY / "philly_jobs.csv"),
        "--partitions",
        str(PHILLY / "philly_vc.csv"),
        "--json",
    ]
    res = runner.invoke(_app(), [*args, "--mode", "static", "--duration-scale", "2"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    for key in (
        "mode",
        "duration_scale",
        "nodes",
        "avg_queue_s",
        "p50_queue_s",
        "p99_queue_s",
        "avg_jct_s",
        "gpu_alloc_pct",
        "preemptions",
        "lost_gpu_hours",
        "lost_work_pct",
        "per_partition",
    ):
        assert key in out
    assert out["mode"] == "static" and out["duration_scale"] == 2 and out["nodes"] == 352
    assert len(out["per_partition"]) == 11
    assert all("published_queue_s" in p for p in out["per_partition"])
    res = runner.invoke(_app(), [*args, "--mode", "pooled", "--nodes", "300"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["mode"] == "pooled" and out["nodes"] == 300


def test_cli_bad_input_exits_2(tmp_path: Path) -> None:
    vc = tmp_path / "vc.csv"
    vc.write_text("vc,node num\na,1\n")
    jobs = _write(tmp_path, HEADER + GOOD + "2017-10-02 00:00:00,-1,1,1,a\n")
    runner = CliRunner()
    res = runner.invoke(_app(), ["replay", "--jobs", str(jobs), "--partitions", str(vc)])
    assert res.exit_code == 2
    assert f"{jobs}:3" in res.output and "Traceback" not in res.output
    res = runner.invoke(_app(), ["replay", "--jobs", str(tmp_path / "nope.csv"), "--partitions", str(vc)])
    assert res.exit_code == 2
    res = runner.invoke(_app(), ["replay", "--jobs", str(jobs), "--partitions", str(vc), "--mode", "fancy"])
    assert res.exit_code == 2
