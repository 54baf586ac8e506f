"""Heterogeneity-aware placement: Gavel's data loaded, the replay's invariants, a hand-made case, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from computepool.scheduler.hetero import HJob, Speeds, assign_round, max_min_shares, queue_order
from computepool.sim.gavel import GavelDataError, TraceJob, load_throughputs, load_trace, parse_cluster
from computepool.sim.hetero import build_jobs, retime, run_agnostic, run_aware

REPO = Path(__file__).resolve().parents[1]
GAVEL = Path(os.environ.get("CPOOL_TRACES", REPO.parent / "shared" / "traces")) / "gavel"
needs_gavel = pytest.mark.skipif(
    not (GAVEL / "simulation_throughputs.json").is_file(), reason="Gavel data not found (set CPOOL_TRACES)"
)


@needs_gavel
def test_loads_the_real_throughputs_and_both_trace_layouts() -> None:
    speeds = load_throughputs(GAVEL / "simulation_throughputs.json")
    assert len(speeds.job_types()) == 26
    rn50 = speeds.rates[("ResNet-50 (batch size 64)", 1)]
    assert rn50["v100"] == pytest.approx(4.3948, abs=1e-3) and rn50["k80"] == pytest.approx(0.619, abs=1e-3)
    # Recommendation is measured on one GPU only: wider runs scale that figure
    rates, measured = speeds.of("Recommendation (batch size 512)", 4)
    assert not measured and rates["p100"] == pytest.approx(4 * 48.8824, abs=1e-3)
    msr = load_trace(GAVEL / "msr-seed0" / "ed69ec.trace")
    assert len(msr) == 951 and {j.scale_factor for j in msr} == {1}
    assert msr[0] == TraceJob(1, "Transformer (batch size 128)", 12304123, 0.0, 1)
    phys = load_trace(GAVEL / "physical_cluster" / "max_min_fairness.trace")  # 10 fields, arrival last
    assert len(phys) == 96 and max(j.arrival_s for j in phys) > 0 and {j.priority for j in phys} == {1.0}
    assert phys[0] == TraceJob(1, "ResNet-18 (batch size 128)", 925982, 0.0, 4)


def test_bad_input_names_the_file_and_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad-fields.trace"
    ok = "A3C\tpython3 main.py\t--steps\t1\t100\t0.0\t1"
    trace.write_text(ok + "\n" + "A3C\tonly\tthree\n")
    with pytest.raises(
        GavelDataError, match=r"bad-fields\.trace:2: 3 tab-separated fields, expected 7 or 10"
    ):
        load_trace(trace)
    trace.write_text(ok.replace("\t100\t", "\tmany\t"))
    with pytest.raises(
        GavelDataError, match=r"bad-fields\.trace:1: total steps 'many' is not a whole number"
    ):
        load_trace(trace)
    thr = tmp_path / "thr-bad.json"
    thr.write_text('{"v100": {"(\'A3C\', 1)": {"other": 3.0}}}')
    with pytest.raises(GavelDataError, match=r"thr-bad\.json: v100 \('A3C', 1\): no numeric throughput"):
        load_throughputs(thr)
    thr.write_text("{not json")
    with pytest.raises(GavelDataError, match=r"thr-bad\.json: not readable JSON"):
        load_throughputs(thr)
    with pytest.raises(ValueError, match="expected V:P:K"):
        parse_cluster("4:4")
    speeds = Speeds({("A3C", 1): {"v100": 1.0}})
    with pytest.raises(GavelDataError, match=r"x\.trace:7: job type 'LM' has no measured throughput"):
        build_jobs([TraceJob(7, "LM", 10, 0.0, 1)], "x.trace", speeds, {"v100": 1}, 8)


def _hand_case() -> tuple[list[TraceJob], Speeds, dict[str, int]]:
    """One V100 and one K80. `fast` runs 10× faster on the V100; `flat` runs equally on both.

    `flat` is first in the queue (same arrival, earlier line).
    """
    speeds = Speeds({("fast", 1): {"v100": 10.0, "k80": 1.0}, ("flat", 1): {"v100": 1.0, "k80": 1.0}})
    trace = [TraceJob(1, "flat", 1800, 0.0, 1), TraceJob(2, "fast", 36000, 0.0, 1)]
    return trace, speeds, {"v100": 1, "p100": 0, "k80": 1}


def test_aware_puts_the_job_that_gains_most_on_the_fast_gpu() -> None:
    trace, speeds, cap = _hand_case()
    jobs, dropped = build_jobs(trace, "hand", speeds, cap, 1)
    assert dropped == 0 and [j.job_type for j in jobs] == ["flat", "fast"]
    # agnostic: `flat` comes first and lands on the first free GPU (the V100), `fast` on the K80
    ag = run_agnostic(jobs, cap, gpus_per_node=1, restart_s=10.0)
    assert {s.job: s.gpu_type for s in ag.segments} == {0: "v100", 1: "k80"}
    assert ag.finish == {0: 10.0 + 1800.0, 1: 10.0 + 36000.0}
    assert ag.avg_jct_s == pytest.approx((1810.0 + 36010.0) / 2)
    # aware: max-min leaves `flat` its full speed on the K80 and gives `fast` the whole V100
    aw = run_aware(jobs, cap, gpus_per_node=1, restart_s=10.0, round_s=360.0)
    assert {s.job: s.gpu_type for s in aw.segments} == {0: "k80", 1: "v100"}
    assert aw.finish == {0: 1810.0, 1: 10.0 + 3600.0}
    assert aw.avg_jct_s == pytest.approx((1810.0 + 3610.0) / 2) and aw.preemptions == 0


def test_max_min_shares_split_the_fast_gpu_when_fairness_needs_it() -> None:
    """A gains 10× on the V100, B 2×: giving A the whole V100 would leave B below A, so they share it."""
    a = HJob(0, 1, {"v100": 10.0, "k80": 1.0})
    b = HJob(1, 1, {"v100": 2.0, "k80": 1.0})
    cap = {"v100": 1, "k80": 1}
    x = max_min_shares([a, b], cap)
    for j in (0, 1):
        assert x[j]["v100"] == pytest.approx(0.5, abs=1e-4) and x[j]["k80"] == pytest.approx(0.5, abs=1e-4)
    # a round: neither has run yet, the older (A) takes the V100, B the K80; after A's round on
    # the V100 and B's on the K80, they swap
    plan = assign_round([a, b], x, {}, {0: 360.0, 1: 360.0}, cap, {})
    assert plan == {0: "v100", 1: "k80"}
    got = {0: {"v100": 360.0}, 1: {"k80": 360.0}}
    assert assign_round([a, b], x, got, {0: 720.0, 1: 720.0}, cap, plan) == {0: "k80", 1: "v100"}
    assert [j.id for j in queue_order([HJob(5, 1, {}, 1.0, 2.0), HJob(6, 1, {}, 2.0, 9.0)])] == [6, 5]


@needs_gavel
@pytest.mark.parametrize("policy", ["agnostic", "aware", "fair"])
def test_replay_invariants_on_a_slice(policy: str) -> None:
    speeds = load_throughputs(GAVEL / "simulation_throughputs.json")
    path = GAVEL / "physical_cluster" / "max_min_fairness.trace"  # 1 to 4 GPUs per job
    cap = {"v100": 4, "p100": 4, "k80": 4}
    jobs, _ = build_jobs(load_trace(path), str(path), speeds, cap, 2)
    jobs = retime(jobs[:30], 30.0, seed=3)
    assert any(j.held > 2 for j in jobs), "the slice has a gang"
    if policy == "agnostic":
        r = run_agnostic(jobs, cap, gpus_per_node=2)
    else:
        r = run_aware(jobs, cap, gpus_per_node=2, blind=policy == "fair")
    assert r.policy == policy
    assert r.completed == len(jobs) == 30
    # never more GPUs of a type in use than exist, at every segment boundary
    for t in sorted({s.start for s in r.segments}):
        for gpu, n in cap.items():
            used = sum(s.gpus for s in r.segments if s.gpu_type == gpu and s.start <= t < s.end)
            assert used <= n
    for j in jobs:
        mine = sorted((s for s in r.segments if s.job == j.id), key=lambda s: s.start)
        assert mine[0].start >= j.arrival
        # one type at a time: a job's stretches never overlap
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:], strict=False))
        # its steps, at the rates of the types it ran on, are exactly its total
        done = sum((s.end - s.start - s.overhead) * j.speeds[s.gpu_type] for s in mine)
        assert done == pytest.approx(j.steps, rel=1e-6)
        assert r.finish[j.id] == mine[-1].end


@needs_gavel
def test_cli_json_and_bad_input(tmp_path: Path) -> None:
    cpool = [sys.executable, "-m", "computepool.cli.main", "sim", "hetero"]
    trace = GAVEL / "physical_cluster" / "small_test.trace"
    r = subprocess.run(
        [*cpool, "--trace", str(trace), "--cluster", "4:4:4", "--jobs", "12", "--rate", "30", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["jobs"] == 12 and out["cluster"]["v100"] == 4 and out["rate_per_h"] == 30.0
    for p in ("agnostic", "aware"):
        assert set(out[p]) >= {"avg_jct_s", "p99_jct_s", "makespan_s", "utilization", "jobs", "completed"}
        assert out[p]["completed"] == 12
    assert out["avg_jct_ratio"] == pytest.approx(
        out["agnostic"]["avg_jct_s"] / out["aware"]["avg_jct_s"], rel=1e-2
    )
    one = subprocess.run(
        [*cpool, "--trace", str(trace), "--cluster", "4:4:4", "--jobs", "3", "--policy", "fair", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert one.returncode == 0, one.stderr
    only = json.loads(one.stdout)
    assert only["fair"]["completed"] == 3 and "agnostic" not in only and "avg_jct_ratio" not in only
    bad = tmp_path / "hetero-cli-bad.trace"
    bad.write_text("A3C\tx\n")
    r = subprocess.run(
        [*cpool, "--trace", str(bad), "--throughputs", str(GAVEL / "simulation_throughputs.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"error: {bad}:1: 2 tab-separated fields, expected 7 or 10"]


def test_a_type_whose_nodes_cannot_hold_a_job_is_never_used_for_it() -> None:
    """10 V100s on nodes of 8 (8 + 2) cannot hold a 9-GPU job (2 × 5); 16 K80s (8 + 8) can."""
    speeds = Speeds({("wide", 8): {"v100": 8.0, "k80": 2.0}, ("wide", 1): {"v100": 1.0, "k80": 0.25}})
    cap = {"v100": 10, "k80": 16}
    jobs, dropped = build_jobs([TraceJob(1, "wide", 900, 0.0, 9)], "t", speeds, cap, 8)
    assert dropped == 0 and jobs[0].held == 10 and jobs[0].speeds["v100"] == 0.0
    for r in (run_agnostic(jobs, cap), run_aware(jobs, cap)):
        assert r.completed == 1 and {s.gpu_type for s in r.segments} == {"k80"}
        assert r.finish[0] == 10.0 + 900 / (9 * 0.25)
    too_wide, dropped = build_jobs([TraceJob(1, "wide", 900, 0.0, 17)], "t", speeds, cap, 8)
    assert too_wide == [] and dropped == 1
