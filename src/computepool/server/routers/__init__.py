"""HTTP routers, thin: parse, call one service function, return its model.

`API_ROUTERS` are mounted under /api/v1 by the app factory; add a new module's router there.
"""

from __future__ import annotations

from fastapi import APIRouter

from computepool.server.routers import (
    agent,
    alerts,
    allocations,
    audit,
    blobs,
    functions,
    gateway,
    identity,
    images,
    nodes,
    peers,
    quotas,
    relay,
    secrets,
    services,
    tenants,
    throughputs,
    usage,
)


def api_routers() -> list[APIRouter]:
    """Every router served under /api/v1, in the order they appear in the OpenAPI document.

    A request is matched against the routes in this order, so the busiest (allocations, then
    the agents' node routes) come first.
    """
    return [
        allocations.router,
        functions.router,
        services.router,
        nodes.router,
        agent.router,
        peers.router,
        identity.router,
        tenants.router,
        images.router,
        quotas.router,
        secrets.router,
        gateway.router,
        usage.router,
        throughputs.router,
        alerts.router,
        audit.router,
        blobs.router,
        relay.router,
    ]
