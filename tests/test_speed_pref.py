"""Speed preference: models ranked by a job type's measured speed (defaults where unmeasured), and
the live scheduler's cycle trying them fastest first while leaving untyped work as it was."""

from __future__ import annotations

from typing import Any

import pytest

from computepool.scheduler.hetero import Speeds
from computepool.scheduler.speed_pref import default_speed, estimate, model_order, rates_for
from computepool.server.scheduling import DevSnap, Live, NodeSnap, Snapshot, decide

FAST = "A100-SXM4-40GB"
SLOW = "V100-SXM2-16GB"


def test_default_speed_reads_the_family_from_the_reported_name() -> None:
    assert default_speed("NVIDIA-H100-80GB-HBM3") == default_speed("H100")
    assert default_speed("A100-SXM4-80GB") == default_speed("A100")
    assert default_speed("A10") != default_speed("A100-PCIE-40GB")  # A10 is not A100
    assert default_speed("Tesla-T4") == default_speed("T4")
    assert default_speed("SIM-GPU") is None and default_speed("GH100X") is None
    ranked = ["H100", "A100", "V100", "T4", "P100", "K80"]
    speeds = [default_speed(m) or 0.0 for m in ranked]
    assert speeds == sorted(speeds, reverse=True) and len(set(speeds)) == len(speeds)


def test_measured_speeds_rank_first_and_scale_the_defaults() -> None:
    # measured slower on the A100 than the defaults say: the measurement wins
    assert model_order({FAST: 5.0, SLOW: 10.0}, [FAST, SLOW]) == [frozenset({SLOW}), frozenset({FAST})]
    # a model never measured: its default relative speed scaled by the type's measured ratio
    est = estimate({SLOW: 10.0}, [FAST, SLOW, "Tesla-K80"])
    assert est[SLOW] == 10.0
    assert est[FAST] == pytest.approx(10.0 * 312.0 / 125.0) and est["Tesla-K80"] == pytest.approx(
        10 * 4.4 / 125
    )
    # unknown models go last, together; one ranked model is no preference at all
    order = model_order({SLOW: 10.0}, [FAST, SLOW, "SIM-A", "SIM-B"])
    assert order == [frozenset({FAST}), frozenset({SLOW}), frozenset({"SIM-A", "SIM-B"})]
    assert model_order({SLOW: 10.0}, [SLOW, "SIM-A"]) is None
    assert model_order({}, [FAST, SLOW]) is None


def test_rates_for_takes_the_count_measured_or_the_nearest_scaled() -> None:
    sp = Speeds({("bert", 4): {FAST: 40.0}, ("bert", 1): {FAST: 12.0, SLOW: 4.0}})
    assert rates_for(sp, "bert", 4) == {FAST: 40.0}
    assert rates_for(sp, "bert", 2) == {FAST: 24.0, SLOW: 8.0}  # from one device, linearly
    assert rates_for(Speeds({("bert", 4): {FAST: 40.0}}), "bert", 8) == {FAST: 80.0}
    assert rates_for(sp, "gpt", 1) == {}


def _request(tenant: str, job_type: str | None = None) -> dict[str, Any]:
    req = {
        "gpus": 1,
        "gpu_milli": 1000,
        "gpu_memory_mib": None,
        "cpu_milli": 1000,
        "memory_mib": 1024,
        "models": None,
        "exclusive": False,
        "isolation": "exclusive",
        "gang_nodes": 1,
        "priority": 0,
        "tenant": tenant,
        "name": "",
    }
    return req | ({"job_type": job_type} if job_type else {})


def _node(name: str, model: str, devices: int) -> NodeSnap:
    devs = tuple(DevSnap(j, model, 16384, 1000, f"GPU-{name}-{j}") for j in range(devices))
    return NodeSnap(
        name=name, cpu_milli=64_000, memory_mib=262_144, devices=devs, state="ready", cordoned=False
    )


def _placed(jobs: list[str | None], speeds: dict[str, Speeds]) -> list[str]:
    """Where one cycle puts 1-device jobs of tenant `a` (a job type or None each), in order."""
    # the pool's default policy puts untyped work on node "n-b" (the slow model) first
    nodes = [_node("n-b", SLOW, 2), _node("n-a", FAST, 2)]
    live = [
        Live(i + 1, "a", "pending", _request("a", jt), 0, 1, True, False, [], [], "", None)
        for i, jt in enumerate(jobs)
    ]
    snap = Snapshot(nodes=nodes, weights={"a": 1.0}, quotas={"a": {}}, live=live)
    snap.speeds = speeds
    binds = {b.id: b.nodes[0] for b in decide(snap).binds}
    return [binds.get(i + 1, "") for i in range(len(jobs))]


def test_a_typed_job_goes_to_its_fastest_model_while_free_then_to_the_slow_one() -> None:
    measured = {"a": Speeds({("resnet50", 1): {FAST: 30.0, SLOW: 10.0}})}
    assert _placed([None], {}) == ["n-b"]  # the scenario: untyped work lands on the slow model
    assert _placed(["resnet50"], measured) == ["n-a"]
    assert _placed(["resnet50"] * 3, measured) == ["n-a", "n-a", "n-b"]  # the fast one full
    # measured the other way round for this type: the slow-by-default model is its fastest
    assert _placed(["rec"], {"a": Speeds({("rec", 1): {FAST: 3.0, SLOW: 9.0}})}) == ["n-b"]


def test_work_without_a_type_or_without_speeds_is_placed_as_before() -> None:
    measured = {"a": Speeds({("resnet50", 1): {FAST: 30.0, SLOW: 10.0}})}
    assert _placed([None, None, None], measured) == _placed([None, None, None], {})
    assert _placed(["bert"], measured) == _placed([None], {})  # a type never measured
    other = {"b": Speeds({("resnet50", 1): {FAST: 30.0, SLOW: 10.0}})}  # another tenant's speeds
    assert _placed(["resnet50"], other) == _placed([None], {})
