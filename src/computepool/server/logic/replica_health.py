"""Health checks of service replicas: many at once, none able to hold up the others.

Each check is bounded in all (connecting, the status and at most HEALTH_READ_BYTES of the body),
not per read as httpx's timeout is: an engine dribbling its answer byte by byte would otherwise
hold the controller's pass, and so every tenant's services. The client has no connection limit
(one tenant's many slow engines cannot keep the others' checks waiting for a connection), and a
check that raises anything is a failed check, never a failed pass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

log = logging.getLogger("computepool.server")
HEALTH_TIMEOUT_S = 2.0  # one health check, connecting and reading included
HEALTH_READ_BYTES = 4096  # of a health answer's body, at most


@dataclass(frozen=True)
class Probe:
    ok: bool
    detail: str


async def check_all(targets: Sequence[tuple[int, str, str | None]]) -> dict[int, Probe]:
    """GET each (allocation, URL, key) showing the key as a bearer token; per allocation, the result."""
    if not targets:
        return {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S, limits=limits, trust_env=False) as client:
        answers = await asyncio.gather(
            *(check(client, url, key) for _, url, key in targets), return_exceptions=True
        )
    out: dict[int, Probe] = {}
    for (alloc_id, url, _), answer in zip(targets, answers, strict=True):
        if isinstance(answer, BaseException):  # check() catches all; still, never stop the pass
            log.warning("service controller: health check of %s: %r", url, answer)
            answer = Probe(False, f"GET {url}: {type(answer).__name__}")
        out[alloc_id] = answer
    return out


async def check(client: httpx.AsyncClient, url: str, key: str | None) -> Probe:
    """One health check: 2xx once at most HEALTH_READ_BYTES of the body came, within HEALTH_TIMEOUT_S."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def get() -> Probe:
        async with client.stream("GET", url, headers=headers) as r:
            if not 200 <= r.status_code < 300:
                return Probe(False, f"GET {url} answered {r.status_code}")
            read = 0
            async for chunk in r.aiter_raw():
                read += len(chunk)
                if read >= HEALTH_READ_BYTES:
                    break
        return Probe(True, "")

    try:
        return await asyncio.wait_for(get(), HEALTH_TIMEOUT_S)
    except TimeoutError:
        return Probe(False, f"GET {url}: no whole answer within {HEALTH_TIMEOUT_S:g} s")
    except httpx.HTTPError as e:
        return Probe(False, f"GET {url}: {type(e).__name__}{': ' + str(e) if str(e) else ''}")
    except Exception as e:  # a URL httpx refuses, a broken answer …: a failed check
        log.warning("service controller: health check of %s: %r", url, e)
        return Probe(False, f"GET {url}: {type(e).__name__}{': ' + str(e) if str(e) else ''}")
