"""Replay a job trace with queues: static per-VC partitions versus one pooled cluster.

Event-driven: jobs arrive at their submit time, wait in their VC's queue, run for
`duration x duration_scale` on whole GPUs, and leave. A job of up to 8 GPUs takes them on one
8-GPU node; a larger one is a gang of ceil(n/8) whole nodes, bound all-or-nothing (it holds,
and is accounted for, all GPUs of those nodes). Placement consolidates: the node with the
fewest free GPUs that still fits, lowest index on ties (numpy over the free-GPU array).

- `static`: each VC owns its listed nodes; strict FIFO per VC (head-of-line blocking).
- `pooled`: one cluster; each VC is guaranteed its static size (scaled down proportionally,
  largest remainder, when the cluster has fewer GPUs than the VCs' sum; kept as is when it
  has more). Per pass, VCs whose head fits within their guarantee are served first (lowest
  usage/guarantee share first) and may preempt borrowed jobs (`scheduler.queueing`); then
  every other VC may borrow idle GPUs, lowest share first. Inside a VC the order is strict
  FIFO (no backfill: run times are not known in advance in a live pool); a blocked VC never
  blocks another. A preempted job goes back to the head of its VC queue and later restarts
  from scratch; its run so far is lost work.

Jobs that can never fit (bigger than their VC in static, than the cluster in pooled) are
counted as `unplaceable` and left out of every other figure.

One module per concern: `results` (figures and result types), `cluster` (nodes and their
placement), `engine` (the event loop and `replay`), `search` (calibration and parity).
"""

from computepool.sim.replay.engine import POLICIES, replay
from computepool.sim.replay.fair import CRITERION, FairParity, VcVerdict, find_fair_parity, verdicts
from computepool.sim.replay.results import Figures, Mode, Progress, ReplayResult, Run
from computepool.sim.replay.search import (
    Calibration,
    Parity,
    VcComparison,
    calibrate,
    compare,
    find_parity,
)

__all__ = [
    "CRITERION",
    "POLICIES",
    "Calibration",
    "FairParity",
    "VcVerdict",
    "find_fair_parity",
    "verdicts",
    "Figures",
    "Mode",
    "Parity",
    "Progress",
    "ReplayResult",
    "Run",
    "VcComparison",
    "calibrate",
    "compare",
    "find_parity",
    "replay",
]
