"""The vocabulary of the pool: quantities, devices, nodes, requests, slices, allocation states."""

from computepool.core.allocation import (
    ENDED,
    HOLDING,
    ISOLATIONS,
    LIVE,
    STATES,
    AllocationState,
    Isolation,
    IsolationName,
    Slice,
)
from computepool.core.errors import InvalidInput
from computepool.core.request import Request, Sharing, parse_models
from computepool.core.resources import Device, Node

__all__ = [
    "ENDED",
    "HOLDING",
    "ISOLATIONS",
    "LIVE",
    "STATES",
    "AllocationState",
    "Device",
    "InvalidInput",
    "Isolation",
    "IsolationName",
    "Node",
    "Request",
    "Sharing",
    "Slice",
    "parse_models",
]
