"""The scheduling controller: snapshot → decisions (pure) → one fenced commit per cycle.

One controller runs per server process; the replica holding the `scheduler_lease` row schedules.
Each cycle:

1. *Lease* (`controller`). Hold or renew the lease; taking it over from an expired holder bumps
   the term.
2. *Snapshot* (`snapshot`, SQL in `store.scheduling`). Nodes (ready and uncordoned are
   schedulable; lost ones are dropped), tenants, quotas and the pending, bound and active
   allocations, read in one transaction.
3. *Decide* (`decide`, no I/O, over a `world.World`; quota arithmetic in `quota`). Stops for
   lost nodes, then pending requests by fair share, placed by the same scheduler code as the
   simulator; preemption of borrowed capacity is tried in a `world.Statement` and rolled back
   when it does not serve the claim.
4. *Commit* (`commit`) every decision in one transaction that first checks, under the lease
   row's lock, that this holder still has the lease in the same term; otherwise nothing is
   written.

Decisions are a function of the snapshot alone (the scorer is rebuilt each cycle and learns
the request distribution from the snapshot in id order), so replicas agree and tests can
replay a cycle.
"""

from computepool.server.scheduling.commit import CommitResult, LostLease, commit
from computepool.server.scheduling.controller import CYCLE_INTERVAL_S, LEASE_TTL_S, Controller, CycleReport
from computepool.server.scheduling.decide import (
    MAX_VICTIM_CANDIDATES,
    Bind,
    Plan,
    Stop,
    build_world,
    decide,
    isolation_of,
    never_fits,
    new_scheduler,
    pool_is_empty,
)
from computepool.server.scheduling.quota import (
    Key,
    QuotaMap,
    Usage,
    estimate,
    host_usage,
    over_limit,
    reclaimable,
    slices_usage,
    within_guarantee,
)
from computepool.server.scheduling.requests import stored_core, to_core
from computepool.server.scheduling.snapshot import (
    DevSnap,
    Live,
    NodeSnap,
    Snapshot,
    SnapshotCache,
    load_snapshot,
    node_state,
    node_states,
)
from computepool.server.scheduling.world import Statement, World

__all__ = [
    "CYCLE_INTERVAL_S",
    "LEASE_TTL_S",
    "MAX_VICTIM_CANDIDATES",
    "Bind",
    "CommitResult",
    "Controller",
    "CycleReport",
    "DevSnap",
    "Key",
    "Live",
    "LostLease",
    "NodeSnap",
    "Plan",
    "QuotaMap",
    "Snapshot",
    "SnapshotCache",
    "Statement",
    "Stop",
    "Usage",
    "World",
    "build_world",
    "commit",
    "decide",
    "estimate",
    "host_usage",
    "isolation_of",
    "load_snapshot",
    "never_fits",
    "new_scheduler",
    "node_state",
    "node_states",
    "over_limit",
    "pool_is_empty",
    "reclaimable",
    "slices_usage",
    "stored_core",
    "to_core",
    "within_guarantee",
]
