"""The OpenAI-compatible gateway in front of model services.

`cpool server` serves it at /v1 beside the API; `cpool gateway` runs it alone on the same
database (as many as wanted). Each process keeps its own routing table, queues and rate-limit
buckets and reports its load for the service controller (`services.service_load`).
"""

from computepool.server.gateway.core import Gateway
from computepool.server.gateway.router import router

__all__ = ["Gateway", "router"]
