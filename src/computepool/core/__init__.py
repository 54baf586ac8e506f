"""The vocabulary of the pool: quantities, devices, nodes, requests, slices, allocations."""

from computepool.core.allocation import Allocation, Isolation, Slice
from computepool.core.errors import InvalidInput
from computepool.core.request import Request, Sharing, parse_models
from computepool.core.resources import Device, Node

__all__ = [
    "Allocation",
    "Device",
    "InvalidInput",
    "Isolation",
    "Node",
    "Request",
    "Sharing",
    "Slice",
    "parse_models",
]
