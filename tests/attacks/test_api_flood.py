"""One tenant's flood of API calls does not take the control plane from the others.

Forty clients of one tenant calling as fast as they could raised another tenant's median answer
time from 7 ms to 787 ms: nothing limited how much of the server one tenant could take. Each
tenant now has a token bucket (`--api-rate` a second, `--api-burst` at once): past it its calls are
answered 429 with Retry-After at once, while another tenant's calls, the node agents' and the
health checks are answered as before.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import httpx
import pytest
from job_node import job_node

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="the pool's node is a root agent")]

RATE, BURST = 5, 10
FLOODERS, CALLS = 8, 60


def test_a_flooding_tenant_gets_429_while_another_is_answered() -> None:
    with job_node("--api-rate", str(RATE), "--api-burst", str(BURST)) as node:
        _, flooder = node.member("flood")
        _, calm = node.member("calm")
        seen: Counter[int] = Counter()
        retry_after: set[str] = set()
        lock = threading.Lock()

        def flood() -> None:
            with httpx.Client(base_url=node.url, headers=dict(flooder.headers), timeout=30) as c:
                for _ in range(CALLS):
                    r = c.get("/api/v1/allocations")
                    with lock:
                        seen[r.status_code] += 1
                        if r.status_code == 429:
                            retry_after.add(r.headers.get("Retry-After", ""))

        started = time.monotonic()
        threads = [threading.Thread(target=flood) for _ in range(FLOODERS)]
        for t in threads:
            t.start()
        calm_codes = [calm.get("/api/v1/allocations").status_code for _ in range(BURST - 1)]
        health = [httpx.get(f"{node.url}/healthz", timeout=30).status_code for _ in range(5)]
        for t in threads:
            t.join()
        took = time.monotonic() - started
        # the other tenant (within its own bucket) and the health checks: never refused
        assert calm_codes == [200] * (BURST - 1) and health == [200] * 5
        # the flooder: at most its burst and rate over the time it flooded, the rest refused
        assert set(seen) <= {200, 429} and seen[200] + seen[429] == FLOODERS * CALLS, seen
        assert seen[200] <= BURST + RATE * took + 1, (seen, took)
        assert seen[429] > 0 and retry_after and all(v.isdigit() and int(v) >= 1 for v in retry_after)
        assert node.states() == ["ready"]  # its agent's heartbeats went on
