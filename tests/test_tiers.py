"""Isolation tiers and MIG instances in placement, checked against an oracle over random streams.

The oracle is written from the rules (docs/isolation.md, docs/scheduler.md), not from the
scheduler's code, and keeps its own ledger of what each device holds:

- a device holds slices of one tier at a time; an exclusive or MIG slice is alone;
- a device's mps slices are one tenant's (one MPS server per GPU runs as one tenant's user);
- `mig` requests land only on MIG instances (of their profile, or the smallest that fits),
  every other request only on whole GPUs;
- no device or node is over-committed, and a device taken whole gives at least the memory asked;
- whenever some node could hold a request under these rules, the scheduler places it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from computepool.core import Device, InvalidInput, Isolation, Node, Request, Sharing
from computepool.core.resources import mig_base_model, mig_profile_of
from computepool.scheduler.placement import Decision, Scheduler
from computepool.scheduler.policies import make_scorer
from computepool.scheduler.state import ClusterState

GPU_MIB = 80 * 1024
PROFILES = {
    "1g.10gb": (1, 10),
    "2g.20gb": (2, 20),
    "3g.40gb": (3, 40),
    "4g.40gb": (4, 40),
    "7g.80gb": (7, 80),
}
LAYOUTS = [
    ("7g.80gb",),
    ("3g.40gb", "2g.20gb", "2g.20gb"),
    ("4g.40gb", "3g.40gb"),
    ("3g.40gb", "3g.40gb"),
    ("2g.20gb", "2g.20gb", "2g.20gb", "1g.10gb"),
    ("1g.10gb",) * 7,
]
POLICIES = ["default", "bestfit", "packing", "firstfit", "random", "clustering", "dotprod"]


def mig_device(index: int, parent: str, profile: str) -> Device:
    slices, gb = PROFILES[profile]
    return Device(
        index=index,
        vendor="nvidia",
        model=f"A100-MIG-{profile}",
        memory_mib=gb * 1024,
        uuid=f"MIG-{parent}-{index}",
        compute_milli=round(1000 * slices / 7),
        mig_parent_uuid=parent,
        mig_profile=profile,
    )


@st.composite
def nodes_st(draw) -> list[Node]:
    nodes = []
    for i in range(draw(st.integers(1, 4))):
        devices: list[Device] = []
        for g in range(draw(st.integers(0, 3))):
            model = draw(st.sampled_from(["A100", "A100", "H100"]))
            layout = draw(st.sampled_from([None, None, *LAYOUTS])) if model == "A100" else None
            if layout is None:
                devices.append(Device(len(devices), "nvidia", model, GPU_MIB, f"GPU-n{i}-{g}"))
            else:
                devices += [mig_device(len(devices), f"GPU-n{i}-{g}", p) for p in layout]
        nodes.append(
            Node(
                name=f"n{i}",
                cpu_milli=draw(st.sampled_from([8000, 64000])),
                memory_mib=draw(st.sampled_from([65536, 262144])),
                devices=devices,
                schedulable=draw(st.sampled_from([True, True, True, False])),
            )
        )
    return nodes


_host = {"cpu_milli": st.sampled_from([0, 1000, 8000]), "memory_mib": st.sampled_from([0, 4096, 65536])}
_gmem = st.sampled_from([None, 0, 8192, 30000, 40960, 100000])
_tenant = st.sampled_from(["", "a", "b"])
requests_st = st.one_of(
    st.builds(  # a fraction, time-sliced or through MPS
        Request,
        gpu_count=st.just(1),
        gpu_milli=st.sampled_from([100, 250, 300, 500, 700]),
        gpu_memory_mib=st.sampled_from([None, 4096, 20000, 50000]),
        isolation=st.sampled_from([None, Isolation.TIMESLICE, Isolation.MPS]),
        tenant=_tenant,
        **_host,
    ),
    st.builds(  # one whole device through MPS
        Request,
        gpu_count=st.just(1),
        gpu_milli=st.just(1000),
        isolation=st.just(Isolation.MPS),
        tenant=_tenant,
        **_host,
    ),
    st.builds(  # whole devices, exclusive
        Request,
        gpu_count=st.integers(1, 3),
        gpu_milli=st.just(1000),
        gpu_memory_mib=_gmem,
        sharing=st.sampled_from([Sharing.SHARED, Sharing.EXCLUSIVE]),
        models=st.sampled_from([None, frozenset({"H100"}), frozenset({"A100"})]),
        **_host,
    ),
    st.builds(  # a named MIG profile (one that no GPU has, too)
        Request,
        gpu_count=st.just(1),
        gpu_milli=st.just(1000),
        mig_profile=st.sampled_from([*PROFILES, "1g.20gb"]),
        models=st.sampled_from([None, frozenset({"A100"}), frozenset({"H100"})]),
        **_host,
    ),
    st.builds(  # isolation=mig: the smallest instance holding the memory and share asked
        Request,
        gpu_count=st.just(1),
        gpu_milli=st.sampled_from([1000, 250, 400]),
        gpu_memory_mib=st.sampled_from([None, 10240, 20000, 30000, 90000]),
        isolation=st.just(Isolation.MIG),
        sharing=st.just(Sharing.EXCLUSIVE),
        **_host,
    ),
    st.builds(Request, **_host),  # CPU only
)
ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("place"), requests_st),
        st.tuples(st.just("release"), st.integers(0, 1000)),
    ),
    min_size=1,
    max_size=40,
)
mps_st = st.builds(  # small mps slices of a few tenants, and time-sliced ones, competing for devices
    Request,
    gpu_count=st.just(1),
    gpu_milli=st.sampled_from([100, 250, 500]),
    gpu_memory_mib=st.sampled_from([None, 4096]),
    isolation=st.sampled_from([Isolation.MPS, Isolation.MPS, Isolation.TIMESLICE]),
    tenant=_tenant,
)
mps_ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("place"), mps_st),
        st.tuples(st.just("place"), mps_st),
        st.tuples(st.just("release"), st.integers(0, 1000)),
    ),
    min_size=4,
    max_size=40,
)


# --- the oracle -----------------------------------------------------------------------------
def expected_tier(r: Request) -> str | None:
    if r.mig_profile is not None:
        return "mig"
    if r.gpu_count == 0:
        return None
    if r.isolation is not None:
        return str(r.isolation)
    if r.sharing == Sharing.EXCLUSIVE or r.gpu_milli == 1000:
        return "exclusive"
    return "timeslice"


@dataclass
class Held:
    tier: str
    milli: int
    mem: int
    tenant: str


@dataclass
class Ledger:
    """What the oracle believes each node and device holds."""

    nodes: list[Node]
    devices: dict[tuple[int, int], list[Held]] = field(default_factory=lambda: defaultdict(list))
    cpu: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    mem: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    def device_fits(self, i: int, j: int, r: Request) -> bool:
        d = self.nodes[i].devices[j]
        tier = expected_tier(r)
        is_mig = d.mig_parent_uuid is not None
        if (tier == "mig") != is_mig:
            return False
        if r.mig_profile is not None and d.mig_profile != r.mig_profile:
            return False
        if r.models is not None and d.model not in r.models and mig_base_model(d.model) not in r.models:
            return False
        held = self.devices[(i, j)]
        if tier in ("mig", "exclusive") or r.gpu_milli == 1000:  # taken whole
            if held or (r.gpu_memory_mib and d.memory_mib < r.gpu_memory_mib):
                return False
            return tier != "mig" or r.gpu_milli == 1000 or d.compute_milli >= r.gpu_milli
        if any(h.tier != tier for h in held):
            return False
        if tier == "mps" and any(h.tenant != r.tenant for h in held):
            return False
        need_mem = r.gpu_memory_mib if r.gpu_memory_mib is not None else d.memory_mib * r.gpu_milli // 1000
        free = d.compute_milli - sum(h.milli for h in held)
        free_mem = d.memory_mib - sum(h.mem for h in held)
        return free >= r.gpu_milli and free_mem >= need_mem

    def node_fits(self, i: int, r: Request) -> list[int]:
        """The devices of node i that could take `r` (empty when the node cannot)."""
        n = self.nodes[i]
        if not n.schedulable or self.cpu[i] + r.cpu_milli > n.cpu_milli:
            return []
        if self.mem[i] + r.memory_mib > n.memory_mib:
            return []
        if r.gpu_count == 0:
            return [-1]
        fit = [j for j in range(len(n.devices)) if self.device_fits(i, j, r)]
        return fit if len(fit) >= r.gpu_count else []

    def apply(self, d: Decision, sign: int) -> None:
        r = d.request
        for pl in d.placements:
            self.cpu[pl.node] += sign * r.cpu_milli
            self.mem[pl.node] += sign * r.memory_mib
            for j in pl.devices:
                slot = self.devices[(pl.node, j)]
                tier = expected_tier(r) or ""
                held = Held(tier, pl.change.gpu_milli[j], pl.change.gpu_memory_mib[j], r.tenant)
                if sign > 0:
                    slot.append(held)
                else:
                    slot.remove(held)

    def check(self) -> None:
        for (i, j), held in self.devices.items():
            if not held:
                continue
            d = self.nodes[i].devices[j]
            tiers = {h.tier for h in held}
            assert len(tiers) == 1, f"tiers mixed on {i}/{j}: {tiers}"
            (tier,) = tiers
            if tier in ("exclusive", "mig"):
                assert len(held) == 1, f"{tier} slice not alone on {i}/{j}"
            if tier == "mps":
                owners = {h.tenant for h in held}
                assert len(owners) == 1, f"mps slices of tenants {owners} share {i}/{j}"
            assert (tier == "mig") == (d.mig_parent_uuid is not None), f"{tier} slice on {d.model}"
            assert sum(h.milli for h in held) <= d.compute_milli, f"compute over-committed on {i}/{j}"
            assert sum(h.mem for h in held) <= d.memory_mib, f"memory over-committed on {i}/{j}"
        for i, n in enumerate(self.nodes):
            assert self.cpu[i] <= n.cpu_milli and self.mem[i] <= n.memory_mib


def check_decision(ledger: Ledger, d: Decision) -> None:
    r = d.request
    tier = expected_tier(r)
    for pl in d.placements:
        assert len(pl.devices) == r.gpu_count
        assert ledger.node_fits(pl.node, r), f"{r} placed on node {pl.node}, which cannot hold it"
        for j in pl.devices:
            dev = ledger.nodes[pl.node].devices[j]
            assert ledger.device_fits(pl.node, j, r), f"{r} placed on device {j} of node {pl.node}"
            if r.gpu_memory_mib:
                assert pl.change.gpu_memory_mib[j] >= r.gpu_memory_mib, "less GPU memory than asked"
            if tier in ("mig", "exclusive") or r.gpu_milli == 1000:
                assert pl.change.gpu_milli[j] == dev.compute_milli
                assert pl.change.gpu_memory_mib[j] == dev.memory_mib
            if tier == "mig" and r.mig_profile is None:  # the smallest instance that fits
                for i in range(len(ledger.nodes)):
                    for k in ledger.node_fits(i, r):
                        other = ledger.nodes[i].devices[k]
                        assert (dev.memory_mib, dev.compute_milli) <= (
                            other.memory_mib,
                            other.compute_milli,
                        ), f"took {dev.model} while {other.model} also fits"


def run_stream(nodes: list[Node], ops: list, policy: str, cache: bool = True) -> list[tuple]:
    state = ClusterState.from_nodes(nodes)
    sched = Scheduler(make_scorer(policy, seed=7), cache=cache)
    ledger = Ledger(nodes)
    live: list[Decision] = []
    trace: list[tuple] = []
    for op, arg in ops:
        if op == "release":
            if live:
                d = live.pop(arg % len(live))
                Scheduler.release(state, d)
                ledger.apply(d, -1)
            continue
        d = sched.place(state, arg)
        fits_somewhere = any(ledger.node_fits(i, arg) for i in range(len(nodes)))
        assert d.ok == fits_somewhere, f"{arg}: scheduler says {d.ok}, oracle says {fits_somewhere}"
        if d.ok:
            check_decision(ledger, d)
            Scheduler.commit(state, d)
            ledger.apply(d, +1)
            live.append(d)
        trace.append((d.ok, [(p.node, tuple(p.devices)) for p in d.placements]))
        state.check_invariants()
        ledger.check()
    return trace


# --- properties -------------------------------------------------------------------------------
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=nodes_st(), ops=ops_st, policy=st.sampled_from(POLICIES))
def test_tiers_never_mix_and_mig_only_on_instances(nodes: list[Node], ops: list, policy: str) -> None:
    run_stream(nodes, ops, policy)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=nodes_st(), ops=mps_ops_st, policy=st.sampled_from(POLICIES))
def test_mps_slices_of_two_tenants_never_share_a_device(nodes: list[Node], ops: list, policy: str) -> None:
    """Random tenants on mps requests: a device's mps slices stay one tenant's, and whenever some
    device could take a request under that rule the scheduler places it."""
    run_stream(nodes, ops, policy)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=nodes_st(), ops=st.one_of(ops_st, mps_ops_st))
def test_class_cache_knows_tiers(nodes: list[Node], ops: list) -> None:
    """Scores cached per node class give the decisions scoring every node afresh gives: the tier
    and kind of each device, and the tenant owning its mps slices, are part of a node's class."""
    assert run_stream(nodes, ops, "default", cache=True) == run_stream(nodes, ops, "default", cache=False)


# --- examples ---------------------------------------------------------------------------------
def one_gpu_pool() -> tuple[ClusterState, Scheduler]:
    node = Node("n0", 64000, 262144, [Device(0, "nvidia", "A100", GPU_MIB, "GPU-0")])
    return ClusterState.from_nodes([node]), Scheduler(make_scorer("default"))


def test_explain_names_the_tier_a_device_holds() -> None:
    state, sched = one_gpu_pool()
    assert sched.schedule(state, Request(gpu_count=1, gpu_milli=300, isolation=Isolation.MPS)).ok
    d = sched.place(state, Request(gpu_count=1, gpu_milli=300))
    assert not d.ok and d.reasons is not None
    assert d.reasons.counts == {"device 0 holds mps slices": 1}
    assert sched.schedule(state, Request(gpu_count=1, gpu_milli=300, isolation=Isolation.MPS)).ok


@pytest.mark.parametrize("policy", ["default", "bestfit"])  # cached per class / scored per node
def test_mps_slices_of_a_device_belong_to_one_tenant(policy: str) -> None:
    node = Node("n0", 64000, 262144, [Device(0, "nvidia", "A100", GPU_MIB, "GPU-0")])
    state, sched = ClusterState.from_nodes([node]), Scheduler(make_scorer(policy))
    mine = Request(gpu_count=1, gpu_milli=300, isolation=Isolation.MPS, tenant="a")
    theirs = replace(mine, tenant="b")
    first = sched.schedule(state, mine)
    assert first.ok
    d = sched.place(state, theirs)
    assert not d.ok and d.reasons is not None
    assert d.reasons.counts == {"device 0 holds another tenant's mps slices": 1}
    second = sched.schedule(state, mine)
    assert second.ok and second.placements[0].devices == [0]
    for done in (first, second):  # the device is b's to take once a's last mps slice has gone
        assert not sched.place(state, theirs).ok
        Scheduler.release(state, done)
    assert sched.schedule(state, theirs).ok
    assert not sched.place(state, mine).ok
    state.check_invariants()


def test_mig_requests_and_whole_gpu_requests_keep_to_their_kind() -> None:
    layout = [mig_device(i, "GPU-p", p) for i, p in enumerate(("3g.40gb", "2g.20gb", "2g.20gb"))]
    nodes = [
        Node("mig", 64000, 262144, layout),
        Node("whole", 64000, 262144, [Device(0, "nvidia", "A100", GPU_MIB)]),
    ]
    state = ClusterState.from_nodes(nodes)
    sched = Scheduler(make_scorer("default"))
    d = sched.schedule(state, Request(gpu_count=1, gpu_milli=1000))
    assert d.ok and d.placements[0].node_name == "whole"
    d = sched.place(state, Request(gpu_count=1, gpu_milli=1000))
    assert not d.ok and d.reasons is not None
    assert d.reasons.counts["GPUs split into MIG instances (ask with mig)"] == 1
    d = sched.schedule(state, Request(gpu_count=1, gpu_milli=1000, mig_profile="2g.20gb"))
    assert d.ok and d.placements[0].node_name == "mig" and d.placements[0].devices == [1]
    # the smallest instance holding 15 GiB is the other 2g.20gb; then only the 3g.40gb is left
    smallest = Request(gpu_count=1, gpu_milli=1000, gpu_memory_mib=15360, isolation=Isolation.MIG)
    assert sched.schedule(state, smallest).placements[0].devices == [2]
    assert sched.schedule(state, smallest).placements[0].devices == [0]
    d = sched.place(state, smallest)
    assert not d.ok and d.reasons is not None and "no idle MIG instance" in d.reasons.counts


def test_whole_device_never_gives_less_memory_than_asked() -> None:
    state, sched = one_gpu_pool()
    d = sched.place(state, Request(gpu_count=1, gpu_milli=1000, gpu_memory_mib=100_000))
    assert not d.ok and d.reasons is not None
    assert d.reasons.counts == {"no GPU with 97.7GiB GPU memory": 1}
    direct = Scheduler(make_scorer("bestfit"))  # scored over all nodes, the other feasibility path
    assert not direct.place(state, Request(gpu_count=1, gpu_milli=1000, gpu_memory_mib=100_000)).ok
    assert sched.place(state, Request(gpu_count=1, gpu_milli=1000, gpu_memory_mib=81920)).ok


@pytest.mark.parametrize(
    ("kwargs", "where"),
    [
        ({"gpu_count": 2, "gpu_milli": 1000, "isolation": Isolation.MPS}, "isolation"),
        ({"gpu_count": 0, "isolation": Isolation.MPS}, "isolation"),
        ({"gpu_count": 2, "gpu_milli": 1000, "mig_profile": "1g.10gb"}, "mig"),
        ({"gpu_count": 2, "gpu_milli": 1000, "isolation": Isolation.MIG}, "isolation"),
        ({"gpu_count": 1, "gpu_milli": 1000, "mig_profile": "5x.1gb"}, "mig"),
        (
            {"gpu_count": 1, "gpu_milli": 1000, "mig_profile": "1g.10gb", "isolation": Isolation.MPS},
            "isolation",
        ),
        ({"gpu_count": 1, "gpu_milli": 500, "isolation": Isolation.EXCLUSIVE}, "isolation"),
        ({"gpu_count": 1, "gpu_milli": 500, "isolation": "bogus"}, "isolation"),
    ],
)
def test_requests_that_break_tier_rules_are_refused(kwargs: dict, where: str) -> None:
    with pytest.raises(InvalidInput) as e:
        Request(**kwargs)
    assert e.value.where == where


def test_profile_names_round_trip_through_model_names() -> None:
    assert mig_profile_of("A100-SXM4-80GB-MIG-3g.40gb") == "3g.40gb"
    assert mig_profile_of("A100-MIG-1g.10gb-me") == "1g.10gb+me"
    assert mig_profile_of("A100-SXM4-80GB") == ""
    assert mig_base_model("H100-80GB-HBM3-MIG-1g.10gb") == "H100-80GB-HBM3"
    r = Request(gpu_count=1, gpu_milli=400, isolation=Isolation.MIG, sharing=Sharing.EXCLUSIVE)
    assert r.tier == Isolation.MIG and r.whole_devices and not r.fractional
    assert replace(r, mig_profile="3g.40gb").kind_key() != r.kind_key()


def test_requests_stored_before_the_tier_rules_still_load() -> None:
    """A pending row accepted before mps/mig meant one device is read without its tier (the
    scheduling cycle must not stop on it); new requests with it are refused."""
    from computepool.server.scheduling import stored_core, to_core

    old = {"gpus": 2, "gpu_milli": 1000, "cpu_milli": 0, "memory_mib": 0, "gang_nodes": 1}
    old |= {"priority": 0, "tenant": "t", "isolation": "mps", "exclusive": False}
    with pytest.raises(InvalidInput):
        to_core(old)
    core = stored_core(old)
    assert core.gpu_count == 2 and core.tier == Isolation.EXCLUSIVE
    with pytest.raises(InvalidInput):
        stored_core({**old, "isolation": "timeslice", "gpu_milli": 500})
