"""The outcome of scheduling: slices of devices bound to a request."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Isolation(StrEnum):
    """How a slice is held to its share (see DESIGN.md, isolation tiers)."""

    EXCLUSIVE = "exclusive"
    MIG = "mig"
    MPS = "mps"
    TIMESLICE = "timeslice"


@dataclass(frozen=True)
class Slice:
    """The part of one device given to one allocation."""

    node: str
    device_index: int
    compute_milli: int
    memory_mib: int
    isolation: Isolation


@dataclass
class Allocation:
    """A request bound to slices (on one node, or several for a gang)."""

    request_id: str
    slices: list[Slice] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    cpu_milli: int = 0
    memory_mib: int = 0
    attempt: int = 1
    term: int = 0
