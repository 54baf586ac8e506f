"""The states of the pool's other objects, as Literal types: the API's models (`wire/`) validate
them and the store's columns are typed with them, so mypy checks every state a module writes.
(An allocation's states, with their groups, are in `allocation.py`.)"""

from __future__ import annotations

from typing import Literal

CallState = Literal["pending", "running", "done", "failed", "cancelled"]  # a function call
FileState = Literal["pending", "done", "failed"]  # a request for a job's files
ReplicaState = Literal["starting", "ready", "unhealthy", "draining"]  # a model service's replica
AlertState = Literal["firing", "resolved"]
DeliveryState = Literal["pending", "sent", "failed"]  # an alert's notification
