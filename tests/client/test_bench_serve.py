"""`cpool bench serve`: the day-shaped trace, and a short real run of both arms on a pool of its own."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from poolkit import SRC

from computepool.client.bench_serve import ServeBenchSettings
from computepool.serving.trace import DayTrace


def test_the_same_seed_gives_the_same_arrivals_and_another_seed_others() -> None:
    a, b = DayTrace(seed=3).arrivals(), DayTrace(seed=3).arrivals()
    assert a == b and len(a) > 100
    assert a == sorted(a) and a[0] >= 0 and a[-1] < 120
    assert DayTrace(seed=4).arrivals() != a
    # the rate is per second of the compressed day: twice the day, about twice the requests
    longer = DayTrace(seed=3, day_s=240).arrivals()
    assert 1.6 < len(longer) / len(a) < 2.4


def test_the_rate_follows_a_day_low_night_two_peaks_and_a_dip_between() -> None:
    t = DayTrace(peak_rps=10, floor=0.05)
    rate = [t.rate_at_hour(h / 4) for h in range(96)]
    assert max(rate) == pytest.approx(10, rel=1e-3)
    night = max(t.rate_at_hour(h) for h in (0, 1, 2, 3, 4))
    assert night < 0.08 * 10  # the floor, a little lifted by the morning's tail
    assert t.rate_at_hour(11) == pytest.approx(10, rel=0.01)  # the midday peak is the highest
    dip = min(t.rate_at_hour(h / 10) for h in range(120, 160))
    afternoon = max(t.rate_at_hour(h / 10) for h in range(155, 190))
    assert dip < 0.7 * afternoon < 0.7 * 10
    assert t.rate_at_hour(8) < t.rate_at_hour(9) < t.rate_at_hour(10)  # the morning ramp
    assert t.rate_at_hour(23) < 0.1 * 10
    # one trace hour lasts day_s / 24 seconds
    assert t.rate(11 * t.hour_s) == pytest.approx(t.rate_at_hour(11))


def test_the_arrivals_follow_the_rate() -> None:
    t = DayTrace(seed=11, day_s=600, peak_rps=8)
    times = t.arrivals()
    expected = t.expected_requests()
    assert abs(len(times) - expected) < 5 * math.sqrt(expected)  # Poisson: within 5 sigma
    hours = t.per_hour(times)
    assert sum(hours) == len(times)
    assert sum(hours[0:5]) * 4 < sum(hours[10:12]) * 5 / 2  # per hour, the night is far quieter
    assert hours.index(max(hours)) in range(9, 19)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"day_s": 0}, "day_s"), ({"peak_rps": -1}, "peak_rps"), ({"floor": 1.5}, "floor")],
)
def test_bad_trace_parameters_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        DayTrace(**kwargs)  # type: ignore[arg-type]


def test_static_is_sized_for_the_peak() -> None:
    s = ServeBenchSettings(peak_rps=6, slots=2, ms_per_token=50, max_tokens=16, gpus=4)
    # 6 requests/s × 0.86 s each ≈ 5.2 in flight at the peak, 2 per engine: 3 replicas
    assert s.peak_replicas == 3
    assert ServeBenchSettings(peak_rps=100, gpus=4).peak_replicas == 4  # never more than the pool
    assert ServeBenchSettings(replicas=2).peak_replicas == 2


def _cpool(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPOOL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))
    env["CPOOL_CGROUP_BASE"] = "none"  # the agents leave the host's cgroups alone
    argv = [sys.executable, "-m", "computepool.cli.main", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.parametrize(
    ("args", "field"), [(["--gpus", "3", "--nodes", "2"], "--gpus"), (["--replicas", "5"], "--replicas")]
)
def test_bad_options_end_in_one_line_naming_the_option(args: list[str], field: str) -> None:
    r = _cpool("bench", "serve", *args, timeout=60)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_a_short_run_prints_both_arms_with_sane_figures() -> None:
    r = _cpool(
        "bench", "serve", "--json", "--day-s", "36", "--peak-rps", "4", "--gpus", "4", "--nodes", "2",
        "--ms-per-token", "30", "--scale-down-delay", "4", timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert {"static", "pooled", "trace", "machine"} <= out.keys()
    trace = out["trace"]
    assert trace["seed"] == 7 and trace["day_s"] == 36 and trace["requests"] == sum(trace["per_hour"])
    peak = out["machine"]["peak_replicas"]
    for arm in ("static", "pooled"):
        fig = out[arm]
        for key in ("p50_ms", "p99_ms", "failed", "gpu_hours", "batch_gpu_hours", "requests"):
            assert key in fig, (arm, key)
        assert fig["requests"] == trace["requests"]
        assert fig["failed"] <= fig["requests"] // 20, fig["error_samples"]
        assert 0 < fig["p50_ms"] <= fig["p99_ms"]
        assert fig["p50_ms"] >= 0.5 * out["machine"]["engine"]["service_s"] * 1000  # the engine's time
        assert 0 < fig["gpu_hours"] <= peak * 24 * 1.01  # never more than the peak's replicas all day
        assert fig["batch_gpu_hours"] >= 0
    # static holds its replicas the whole day (they were ready before it began)
    assert out["static"]["gpu_hours"] >= peak * 24 * 0.9
    assert out["static"]["ready_replicas_max"] == peak
