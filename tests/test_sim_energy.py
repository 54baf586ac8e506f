"""The simulator's energy and cost: the power model on hand-computed placements and replays."""

from __future__ import annotations

import json

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from computepool.cli import main as cli_main
from computepool.cli.sim_replay import register
from computepool.core import Device, InvalidInput, Node, Request
from computepool.core.power import model_power
from computepool.sim.alibaba import Pod
from computepool.sim.energy import (
    J_PER_KWH,
    compare_replays,
    replay_energy,
    saving,
    snapshot_energy,
    timed_energy,
)
from computepool.sim.fill import run_fill
from computepool.sim.philly import JobTrace, VirtualCluster
from computepool.sim.prices import Prices
from computepool.sim.replay import replay
from computepool.sim.sharing import static_vs_pooled

T4 = model_power("T4")
P100 = model_power("P100")


def t4_nodes(n: int, per_node: int = 1) -> list[Node]:
    return [
        Node(f"n{i}", 64000, 262144, [Device(j, "nvidia", "T4", 16384) for j in range(per_node)])
        for i in range(n)
    ]


def frac(name: str, milli: int) -> Pod:
    return Pod(name, Request(gpu_count=1, gpu_milli=milli, cpu_milli=1000))


# --- prices --------------------------------------------------------------------------------------


def test_prices_parse_and_reject() -> None:
    p = Prices.parse(["V100M32=2.5", " T4 = 0.5"], default_gpu_hour=1.25, kwh=0.2)
    assert p.per_gpu_hour("V100M32") == 2.5 and p.per_gpu_hour("T4") == 0.5
    assert p.per_gpu_hour("A10") == 1.25 and p.kwh == 0.2
    for bad, where in (
        (["V100"], "--gpu-price"),
        (["=2"], "--gpu-price"),
        (["T4=cheap"], "--gpu-price T4"),
        (["T4=-1"], "--gpu-price T4"),
        (["T4=nan"], "--gpu-price T4"),
    ):
        with pytest.raises(InvalidInput) as e:
            Prices.parse(bad)
        assert e.value.where == where
    with pytest.raises(InvalidInput, match="non-negative"):
        Prices.parse([], kwh=-0.1)


# --- a placement held for an hour ------------------------------------------------------------


def test_snapshot_energy_by_hand() -> None:
    # three T4s: one half used, one held whole but idle, one empty
    models = ["T4", "T4", "T4"]
    cap = np.array([1000, 1000, 1000])
    held = np.array([500, 1000, 0])
    used = np.array([500, 0, 0])
    prices = Prices({"T4": 0.4}, kwh=0.1)
    e = snapshot_energy(models, cap, held, used, prices, hours=2.0)
    busy_w = T4.idle_w + (T4.peak_w - T4.idle_w) * 0.5
    assert e.busy_kwh == pytest.approx(busy_w * 2 / 1000)
    assert e.idle_held_kwh == pytest.approx(T4.idle_w * 2 / 1000)
    assert e.idle_empty_kwh == pytest.approx(T4.idle_w * 2 / 1000)
    assert e.energy_kwh == pytest.approx(e.busy_kwh + e.idle_held_kwh + e.idle_empty_kwh)
    assert e.served_gpu_hours == pytest.approx(0.5 * 2)
    assert e.cost_devices == pytest.approx(3 * 0.4 * 2)
    assert e.cost_energy == pytest.approx(e.energy_kwh * 0.1)
    assert e.cost_per_served_gpu_hour == pytest.approx((e.cost_devices + e.cost_energy) / 1.0)
    off = snapshot_energy(models, cap, held, used, prices, hours=2.0, empty_powered=False)
    assert off.idle_empty_kwh == 0 and off.energy_kwh == pytest.approx(e.energy_kwh - e.idle_empty_kwh)


def test_fill_energy_counts_shares() -> None:
    """Pods never leave: the end state of a tiny fill is known, so is its draw."""
    pods = [frac("a", 300), frac("b", 300), frac("c", 300)]
    res = run_fill(t4_nodes(2), pods, "bestfit", 42, tune=0.45, offline=False)  # no copies
    assert res.pods_failed == 0
    end = res.energy["at_end"]
    assert isinstance(end, dict)
    # bestfit packs all three on one device: 90% busy there, the other device empty
    want_w = T4.idle_w + (T4.peak_w - T4.idle_w) * 0.9 + T4.idle_w
    assert end["energy_kwh"] == pytest.approx(want_w / 1000, abs=1e-4)
    assert end["served_gpu_hours"] == pytest.approx(0.9)
    model = res.energy["power_model"]
    assert isinstance(model, dict) and model["models"]["T4"]["peak_w"] == T4.peak_w  # type: ignore[index]
    assert "source" in model["models"]["T4"]  # type: ignore[index]


def test_static_vs_pooled_energy_by_hand() -> None:
    """Static rounds 300-milli requests up to whole T4s; the pool packs them."""
    pods = [frac("a", 300), frac("b", 300), frac("c", 300)]
    res = static_vs_pooled(t4_nodes(2), pods, seed=42, tune=0.45, prices=Prices({"T4": 1.0}, kwh=0.5))
    st, po = res["static"].energy["at_end"], res["pooled"].energy["at_end"]
    assert isinstance(st, dict) and isinstance(po, dict)
    # static: two devices each 30% busy, third pod fails; pooled: one device 90% busy, one empty
    static_w = 2 * (T4.idle_w + (T4.peak_w - T4.idle_w) * 0.3)
    pooled_w = T4.idle_w + (T4.peak_w - T4.idle_w) * 0.9 + T4.idle_w
    assert st["energy_kwh"] == pytest.approx(static_w / 1000, abs=1e-4)
    assert po["energy_kwh"] == pytest.approx(pooled_w / 1000, abs=1e-4)
    assert st["served_gpu_hours"] == pytest.approx(0.6) and po["served_gpu_hours"] == pytest.approx(0.9)
    assert po["kwh_per_served_gpu_hour"] < st["kwh_per_served_gpu_hour"]
    assert po["cost_per_served_gpu_hour"] < st["cost_per_served_gpu_hour"]


# --- a replay over time ----------------------------------------------------------------------


def test_timed_energy_by_hand() -> None:
    prices = Prices({"P100": 2.0}, kwh=0.1)
    e = timed_energy("P100", 16, 3600.0, 7200.0, 9000.0, 1800.0, prices)
    assert e.busy_kwh == pytest.approx(7200 * P100.peak_w / J_PER_KWH)
    assert e.idle_held_kwh == pytest.approx(1800 * P100.idle_w / J_PER_KWH)
    assert e.idle_empty_kwh == pytest.approx((16 * 3600 - 9000) * P100.idle_w / J_PER_KWH)
    assert e.lost_kwh == pytest.approx(1800 * P100.peak_w / J_PER_KWH)
    assert e.served_gpu_hours == pytest.approx((7200 - 1800) / 3600)
    assert e.cost_devices == pytest.approx(16 * 1.0 * 2.0)


def test_replay_energy_matches_the_jobs() -> None:
    """One 8-GPU node: a 4-GPU job 0–100 s, an 8-GPU job that waits for it, 100–200 s."""
    vcs = [VirtualCluster("a", 1)]
    t = JobTrace.from_jobs(vcs, [(0.0, 100.0, 4, "a"), (0.0, 100.0, 8, "a")])
    r = replay(t, "static")
    assert r.window_s == pytest.approx(200.0)
    assert r.used_gpu_s == pytest.approx(4 * 100 + 8 * 100)
    e = replay_energy(r, "P100", Prices())
    assert e.busy_kwh == pytest.approx(1200 * P100.peak_w / J_PER_KWH)
    assert e.idle_empty_kwh == pytest.approx((8 * 200 - 1200) * P100.idle_w / J_PER_KWH)
    assert e.idle_held_kwh == 0


def test_gang_spare_gpus_are_idle_waste() -> None:
    """A 12-GPU job holds two whole nodes: 4 GPUs held and idle for its run."""
    t = JobTrace.from_jobs([VirtualCluster("a", 2)], [(0.0, 50.0, 12, "a")])
    r = replay(t, "static")
    assert r.held_gpu_s == pytest.approx(16 * 50) and r.used_gpu_s == pytest.approx(12 * 50)
    e = replay_energy(r, "P100", Prices())
    assert e.idle_held_kwh == pytest.approx(4 * 50 * P100.idle_w / J_PER_KWH)


def test_compare_replays_uses_one_horizon_and_reports_savings() -> None:
    vcs = [VirtualCluster("a", 1), VirtualCluster("b", 1)]
    jobs = [(0.0, 100.0, 8, "a"), (0.0, 300.0, 2, "b")]
    t = JobTrace.from_jobs(vcs, jobs)
    st = replay(t, "static")
    po = replay(t, "pooled", nodes=1)
    out = compare_replays({"static": st, "pooled": po}, "P100", Prices())
    horizon = max(st.window_s, po.window_s)
    assert out["horizon_hours"] == pytest.approx(round(horizon / 3600, 2))
    s, p = out["static"], out["pooled"]
    assert isinstance(s, dict) and isinstance(p, dict)
    assert s["devices"] == 16 and p["devices"] == 8
    # the same work, so the same busy energy; half the cluster idles for the pool
    assert s["busy_kwh"] == pytest.approx(p["busy_kwh"])
    assert p["idle_empty_kwh"] < s["idle_empty_kwh"]
    sav = out["pooled_vs_static"]
    assert isinstance(sav, dict) and sav["energy_saved_kwh"] > 0 and sav["cost_saved"] > 0


def test_saving_sign() -> None:
    a = timed_energy("P100", 16, 3600.0, 0.0, 0.0, 0.0, Prices())
    b = timed_energy("P100", 8, 3600.0, 0.0, 0.0, 0.0, Prices())
    s = saving(a, b)
    assert s["energy_saved_pct"] == pytest.approx(50.0) and s["cost_saved_pct"] == pytest.approx(50.0)


# --- command line ----------------------------------------------------------------------------


def _replay_app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.command()
    def other() -> None:
        """Placeholder."""

    return app


def test_replay_cli_energy_json_and_bad_prices(tmp_path) -> None:
    vc = tmp_path / "vc.csv"
    vc.write_text("vc,node num\na,1\nb,1\n")
    jobs = tmp_path / "jobs.csv"
    jobs.write_text(
        "timestamp,duration,num_gpus,gpu_time,cluster\n"
        "2017-10-02 00:00:00,100,8,800,a\n"
        "2017-10-02 00:00:00,300,2,600,b\n"
    )
    base = ["replay", "--jobs", str(jobs), "--partitions", str(vc)]
    runner = CliRunner()
    res = runner.invoke(_replay_app(), [*base, "--json", "--gpu-price", "P100=2", "--kwh-price", "0.3"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    energy = out["energy"]
    assert energy["prices"]["gpu_hour"]["P100"] == 2 and energy["prices"]["kwh"] == 0.3
    assert energy["static"]["busy_kwh"] == pytest.approx(1400 * P100.peak_w / J_PER_KWH, abs=1e-4)
    assert energy["power_model"]["models"]["P100"]["idle_w"] == P100.idle_w
    res = runner.invoke(_replay_app(), [*base, "--gpu-price", "P100"])
    assert res.exit_code == 2 and "MODEL=AMOUNT" in res.output and "Traceback" not in res.output
    res = runner.invoke(_replay_app(), [*base, "--mode", "pooled", "--policy", "greedy"])
    assert res.exit_code == 2 and "--policy" in res.output


def test_fill_cli_static_vs_pooled_energy(tmp_path) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,1,T4\nn1,64000,262144,1,T4\n")
    pods = tmp_path / "pods.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1000,1024,1,300\nb,1000,1024,1,300\n")
    if not any(c.name == "fill" for c in cli_main.sim_app.registered_commands):
        cli_main._register()
    runner = CliRunner()
    args = ["sim", "static-vs-pooled", "--cluster", str(nodes), "--workload", str(pods), "--tune", "0.3"]
    res = runner.invoke(cli_main.app, [*args, "--json", "--empty-off"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    st, po = out["static"]["energy"]["at_end"], out["pooled"]["energy"]["at_end"]
    assert st["idle_empty_kwh"] == 0 and po["idle_empty_kwh"] == 0
    assert po["energy_kwh"] < st["energy_kwh"]  # one device at 60% against two at 30%, none idle
    assert out["savings"]["at_end"]["kwh_per_served_gpu_hour_saved_pct"] > 0
    assert out["static"]["energy"]["power_model"]["empty_devices"].startswith("powered off")
    res = runner.invoke(cli_main.app, [*args, "--kwh-price", "-1"])
    assert res.exit_code != 0 and "--kwh-price" in res.output and "Traceback" not in res.output
