"""The rules as pure functions of what a pass reads: properties over heartbeat ages and device use."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from computepool.server.alerts.rules import BY_NAME, Facts, idle_devices, node_lost, node_suspect
from computepool.server.settings import ServerSettings
from computepool.store.alerts import DeviceSeen, HeldAlloc, NodeSeen, RuleSetting

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SETTINGS = ServerSettings(suspect_after_s=20.0, lost_after_s=60.0)


def facts(
    nodes: list[NodeSeen],
    devices: list[DeviceSeen] | None = None,
    held: list[HeldAlloc] | None = None,
    observed_since: datetime | None = None,
) -> Facts:
    return Facts(
        now=NOW,
        nodes=nodes,
        devices=devices or [],
        held=held or [],
        ends=[],
        snapshot=None,
        term=1,
        term_before=None,
        term_changed=False,
        term_first_seen=NOW,
        audit_problem=None,
        settings=SETTINGS,
        lost_after_s=SETTINGS.lost_after_s,
        observed_since=observed_since,
    )


@given(
    st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), max_size=20),
    st.one_of(st.none(), st.floats(min_value=0, max_value=1e6, allow_nan=False)),
)
def test_a_node_is_suspect_or_lost_never_both_and_only_when_silent(
    ages: list[float], leading_s: float | None
) -> None:
    """Silence counts from the later of the last heartbeat and when this replica began to lead:
    after a failover or an outage of the database, no node is suspect or lost for the gap."""
    nodes = [NodeSeen(f"n{i}", NOW - timedelta(seconds=a)) for i, a in enumerate(ages)]
    since = None if leading_s is None else NOW - timedelta(seconds=leading_s)
    f = facts(nodes, observed_since=since)
    suspect = {x.subject for x in node_suspect(f, BY_NAME["node-suspect"].default(SETTINGS))}
    lost = {x.subject for x in node_lost(f, BY_NAME["node-lost"].default(SETTINGS))}
    assert not suspect & lost
    quiet = [(NOW - max(n.last_heartbeat_at, since or n.last_heartbeat_at)).total_seconds() for n in nodes]
    silent = sum(1 for a in quiet if a >= 20.0)
    braked = silent >= SETTINGS.lost_brake_min_nodes and silent > SETTINGS.lost_brake_share * len(ages)
    for n, age in zip(nodes, quiet, strict=True):
        assert (f"node/{n.name}" in lost) == (age >= 60.0 and not braked)  # the brake: none lost
        assert (f"node/{n.name}" in suspect) == (20.0 <= age < 60.0)


@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.floats(min_value=0, max_value=100)),  # utilization
            st.floats(min_value=0, max_value=120),  # heartbeat age
        ),
        min_size=1,
        max_size=8,
    ),
    st.floats(min_value=0, max_value=100),
)
def test_idle_devices_names_exactly_the_fresh_idle_ones(
    devices: list[tuple[float | None, float]], threshold: float
) -> None:
    seen = [
        DeviceSeen("n1", i, "A100", "", util, NOW - timedelta(seconds=age))
        for i, (util, age) in enumerate(devices)
    ]
    held = [HeldAlloc(7, "t", "u", "train", tuple(("n1", i) for i in range(len(devices))))]
    found = idle_devices(facts([], seen, held), RuleSetting(True, threshold, 0))
    want = [
        f"n1/{i}"
        for i, (util, age) in enumerate(devices)
        if util is not None and age <= SETTINGS.suspect_after_s and util <= threshold
    ]
    if not want:
        assert found == []  # a silent node, or busy devices: no alert
    else:
        [f] = found
        assert f.subject == "allocation/7" and f.tenant == "t" and f.detail["idle_devices"] == want
