"""The cooperative placement planner: which devices hold which layers, from memory and measured speed.

Worked examples check the rules one at a time; property tests check, over random pools, what must
hold for every plan: contiguous layers that add up to the model, memory respected, no split chosen
that is predicted slower than the fastest single device that holds the model (unless forced), a
split whenever no single device holds it and one fits, and no pair of nodes without a measured link.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from computepool.serving.coop.planner import (
    MEMORY_MARGIN,
    MIB,
    Candidate,
    Link,
    ModelShape,
    Plan,
    Shard,
    hop_seconds,
    layer_params,
    plan,
)

GIB = 1 << 30
# a 40-layer model of 40 GiB: layers of ~1 GiB, embeddings + output 1 GiB
BIG = ModelShape(n_layers=40, model_bytes=40 * GIB, layer_bytes=GIB - 32 * MIB, embd_bytes=GIB,
                 n_embd=8192, n_vocab=128_000)  # fmt: skip
TINY = ModelShape(
    n_layers=2, model_bytes=231_424, layer_bytes=82_468, embd_bytes=66_488, n_embd=64, n_vocab=259
)
FAST_LAN = 0.3, 1000.0


def link(a: str, b: str, rtt_ms: float | None = FAST_LAN[0], mbps: float | None = FAST_LAN[1]) -> Link:
    return Link(a=a, b=b, rtt_ms=rtt_ms, bandwidth_mbps=mbps)


def cpu(node: str, memory_gib: float, tps: float | None) -> Candidate:
    return Candidate(node=node, device="cpu", memory_mib=int(memory_gib * 1024), tokens_per_s=tps)


def nodes_of(p: Plan) -> list[str]:
    return [s.node for s in p.chosen.shards] if p.chosen else []


def test_the_fastest_single_device_that_holds_the_model_wins_over_splits() -> None:
    cands = [cpu("a", 64, 10.0), cpu("b", 64, 9.0), cpu("c", 64, 8.0)]
    p = plan(BIG, cands, [link("a", "b"), link("a", "c"), link("b", "c")], max_nodes=3, min_gain=1.1)
    assert nodes_of(p) == ["a"] and p.chosen is p.best_single
    assert p.chosen.shards[0].layers == 40 and p.chosen.predicted_tokens_per_s == 10.0
    assert "a/cpu" in p.reason and "fastest" in p.reason
    assert any(len(o.shards) > 1 for o in p.options)  # the splits were weighed and lost


def test_no_single_device_holds_the_model_so_it_is_split_by_memory_and_speed() -> None:
    cands = [cpu("a", 24, 10.0), cpu("b", 24, 5.0)]
    p = plan(BIG, cands, [link("a", "b")], max_nodes=4, min_gain=1.1)
    assert p.best_single is None
    assert p.chosen is not None and {s.node for s in p.chosen.shards} == {"a", "b"}
    head, rpc = p.chosen.shards
    assert (head.role, rpc.role) == ("head", "rpc")
    assert head.first_layer == 0 and rpc.first_layer == head.layers and head.layers + rpc.layers == 40
    # the faster node takes as many layers as its memory allows
    fast = head if head.node == "a" else rpc
    assert (fast.layers + 1) * BIG.layer_bytes * MEMORY_MARGIN > 24 * GIB
    assert "no single device holds the model" in p.reason


def test_a_pair_without_a_measured_link_is_never_used() -> None:
    cands = [cpu("a", 24, 10.0), cpu("b", 24, 5.0), cpu("c", 24, 4.0)]
    # a-b has no bandwidth measured, b-c no rtt: only a-c can carry a split
    links = [link("a", "b", mbps=None), link("b", "c", rtt_ms=None), link("a", "c")]
    p = plan(BIG, cands, links, max_nodes=2, min_gain=1.1)
    assert sorted(nodes_of(p)) == ["a", "c"]
    assert plan(BIG, cands[:2], links[:1], max_nodes=2, min_gain=1.1).chosen is None


def test_unmeasured_devices_are_not_used() -> None:
    p = plan(BIG, [cpu("a", 64, None), cpu("b", 64, 3.0)], [link("a", "b")], max_nodes=2, min_gain=1.1)
    assert nodes_of(p) == ["b"]


def test_forced_splits_take_the_best_option_of_that_size_whatever_the_speeds() -> None:
    cands = [cpu("a", 1, 2000.0), cpu("b", 1, 1800.0)]
    two = plan(TINY, cands, [link("a", "b")], max_nodes=4, min_gain=1.1, force_split=2)
    assert nodes_of(two) == ["a", "b"] and [s.layers for s in two.chosen.shards] == [1, 1]  # type: ignore[union-attr]
    assert two.chosen.predicted_tokens_per_s < 2000.0  # type: ignore[union-attr]
    assert "forced over 2 nodes" in two.reason
    one = plan(TINY, cands, [link("a", "b")], max_nodes=4, min_gain=1.1, force_split=1)
    assert nodes_of(one) == ["a"] and "forced onto one device" in one.reason
    three = plan(TINY, cands, [link("a", "b")], max_nodes=4, min_gain=1.1, force_split=3)
    assert three.chosen is None and "forced over 3 nodes" in three.reason


def test_with_a_head_node_every_option_starts_there() -> None:
    cands = [cpu("a", 64, 10.0), cpu("b", 64, 9.0)]
    p = plan(BIG, cands, [link("a", "b")], max_nodes=2, min_gain=1.1, head_node="b")
    assert all(o.shards[0].node == "b" for o in p.options)
    assert p.best_single is not None and p.best_single.shards[0].node == "a"
    assert p.chosen is None and "not on b" in p.reason  # the controller tries a as head instead
    forced = plan(BIG, cands, [link("a", "b")], max_nodes=2, min_gain=1.1, head_node="b", force_split=2)
    assert nodes_of(forced) == ["b", "a"]


def test_a_split_predicted_faster_by_min_gain_is_chosen() -> None:
    # b's measured speed was taken under memory pressure: it is far slower alone than its share of
    # the layers costs next to a fast node with little memory
    cands = [cpu("a", 30, 100.0), cpu("b", 64, 1.0)]
    p = plan(BIG, cands, [link("a", "b")], max_nodes=2, min_gain=1.5)
    assert p.best_single is not None and p.best_single.shards[0].node == "b"
    assert p.chosen is not None and len(p.chosen.shards) == 2
    assert p.chosen.predicted_tokens_per_s >= 1.5 * p.best_single.predicted_tokens_per_s
    slow_link = [link("a", "b", rtt_ms=5000.0)]
    assert nodes_of(plan(BIG, cands, slow_link, max_nodes=2, min_gain=1.5)) == ["b"]


def test_hop_cost_grows_with_round_trip_and_shrinks_with_bandwidth() -> None:
    near, far = (
        hop_seconds(BIG, link("a", "b", 0.2, 1000.0), False),
        hop_seconds(BIG, link("a", "b", 2.0, 1000.0), False),
    )
    assert math.isclose(far - near, 1.8e-3)  # one round trip per token per hop
    thin = hop_seconds(BIG, link("a", "b", 0.2, 10.0), True)
    assert thin > hop_seconds(BIG, link("a", "b", 0.2, 10.0), False) > near


def test_layer_params_for_head_py() -> None:
    head = Shard("a", "cpu", "head", 0, 10, 1, 1.0)
    r1 = Shard("b", "cpu", "rpc", 10, 20, 1, 1.0)
    r2 = Shard("c", "cpu", "rpc", 30, 10, 1, 1.0)
    # llama.cpp offloads the last K of n_layer + 1 (output included) layers, split by proportion
    assert layer_params([head, r1, r2]) == (31, [20.0, 11.0])
    assert layer_params([head]) == (0, [])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="max_nodes"):
        plan(TINY, [], [], max_nodes=0, min_gain=1.1)


Pool = tuple[ModelShape, list[Candidate], list[Link], int, float]


@st.composite
def pools(draw: st.DrawFn) -> Pool:
    n_layers = draw(st.integers(1, 48))
    layer = draw(st.integers(1, 4 * GIB))
    embd = draw(st.integers(0, 2 * GIB))
    model = ModelShape(n_layers, n_layers * layer + embd, layer, embd, draw(st.integers(0, 16384)),
                       draw(st.integers(0, 200_000)))  # fmt: skip
    count = draw(st.integers(1, 6))
    names = [f"n{i}" for i in range(count)]
    cands = [
        Candidate(name, "cpu", draw(st.integers(1, 200_000)), draw(st.none() | st.floats(0.01, 5000)))
        for name in names
    ]
    links = [
        Link(a, b, draw(st.none() | st.floats(0, 50)), draw(st.none() | st.floats(0.1, 100_000)))
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        if draw(st.booleans())
    ]
    return model, cands, links, draw(st.integers(1, 6)), draw(st.floats(1.0, 3.0))


def usable(links: list[Link], a: str, b: str) -> bool:
    return any({k.a, k.b} == {a, b} and k.rtt_ms is not None and (k.bandwidth_mbps or 0) > 0 for k in links)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pools(), st.none() | st.integers(1, 4))
def test_every_plan_is_sound(
    pool: tuple[ModelShape, list[Candidate], list[Link], int, float], force: int | None
) -> None:
    model, cands, links, max_nodes, min_gain = pool
    p = plan(model, cands, links, max_nodes=max_nodes, min_gain=min_gain, force_split=force)
    assert p.reason
    by_device = {(c.node, c.device): c for c in cands}
    holders = [c for c in cands if c.tokens_per_s and model.model_bytes * MEMORY_MARGIN <= c.memory_mib * MIB]
    for option in p.options:
        shards = option.shards
        # contiguous layers, head first, adding up to the model; one shard per node
        assert [s.first_layer for s in shards] == [
            sum(x.layers for x in shards[:i]) for i in range(len(shards))
        ]
        assert sum(s.layers for s in shards) == model.n_layers and all(s.layers >= 1 for s in shards)
        assert shards[0].role == "head" and all(s.role == "rpc" for s in shards[1:])
        assert len({s.node for s in shards}) == len(shards)
        for s in shards:  # memory respected, by the shard's own need and by the device's memory
            c = by_device[(s.node, s.device)]
            assert c.tokens_per_s is not None
            assert s.memory_mib <= c.memory_mib or s.memory_mib == 1
            assert s.layers * model.layer_bytes * MEMORY_MARGIN <= c.memory_mib * MIB
        for s in shards[1:]:
            assert usable(links, shards[0].node, s.node)
    if holders:
        assert p.best_single is not None
        assert p.best_single.predicted_tokens_per_s == max(c.tokens_per_s or 0 for c in holders)
    chosen = p.chosen
    if force is None and chosen is not None and p.best_single is not None and len(chosen.shards) > 1:
        assert chosen.predicted_tokens_per_s >= min_gain * p.best_single.predicted_tokens_per_s
    if force is None and not holders and any(len(o.shards) > 1 for o in p.options):
        assert chosen is not None and len(chosen.shards) > 1
    if force is None and holders:
        assert chosen is not None
    if force is not None and chosen is not None:
        assert len(chosen.shards) == force
