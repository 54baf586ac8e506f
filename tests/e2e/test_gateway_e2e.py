"""The whole path: a service at zero on a real pool (`cpool up`), woken by a request through the
gateway, scaled up by load and back to zero when idle, its replicas real engines run by the agent
as the tenant's user."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from e2e_helpers import JOB_PYTHON, job_readable_copy, local_pool, wait_for

import computepool

# a copy jobs can read wherever the checkout is (their sandbox hides /tmp)
SIMENGINE = job_readable_copy(Path(computepool.__file__).parent / "serving" / "simengine.py")


def test_a_request_wakes_the_service_load_scales_it_idle_ends_it(tmp_path: Path) -> None:
    with local_pool(tmp_path) as (env, pool):
        # the engine file is world-readable in this checkout: the tenant's user runs it from there
        command = [JOB_PYTHON, str(SIMENGINE), "--slots", "1", "--ms-per-token", "40"]
        spec = {
            "request": {"command": command, "cpu_milli": 200},
            "min_replicas": 0,
            "max_replicas": 2,
            "target_inflight": 1,
            "max_inflight": 1,
            "idle_s": 6,
            "scale_down_delay_s": 2,
            "drain_s": 5,
            "startup_grace_s": 120,
            "queue_timeout_s": 90,
        }
        r = pool.http.put("/api/v1/services/chat", json={"spec": spec})
        assert r.status_code == 201, r.text
        assert pool.http.get("/api/v1/services/chat").json()["replicas"] == []  # at zero
        token = env["CPOOL_TOKEN"]
        gw = httpx.Client(base_url=pool.url, verify=pool.verify, timeout=120,
                          headers={"Authorization": f"Bearer {token}"})  # fmt: skip

        def show() -> str:
            return pool.http.get("/api/v1/services/chat").text

        def ask(tokens: int) -> httpx.Response:
            body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens}
            return gw.post("/v1/chat/completions", json=body)

        # from zero: the request waits in the gateway until the controller's replica is ready
        first = ask(4)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["completion_tokens"] == 4
        out = pool.http.get("/api/v1/services/chat").json()
        assert [r["replica_state"] for r in out["replicas"]] == ["ready"]

        # sustained load of four at once with one request per replica: a second replica starts
        def busy() -> dict[str, Any] | None:
            with ThreadPoolExecutor(4) as ex:
                codes = [r.status_code for r in ex.map(lambda _: ask(40), range(4))]
            assert codes == [200] * 4
            got = pool.http.get("/api/v1/services/chat").json()
            ready = [r for r in got["replicas"] if r["replica_state"] == "ready"]
            return got if len(ready) == 2 else None

        # two ready replicas: the controller scaled up (once the burst ends it may already have
        # lowered `desired` again, so that is not asserted here)
        scaled = wait_for("a second replica under load", busy, 120, show)
        hosts = {r["endpoint"] for r in scaled["replicas"]}
        assert len(hosts) == 2  # two ports

        # idle: drained one by one, then to zero
        wait_for(
            "scaled to zero",
            lambda: pool.http.get("/api/v1/services/chat").json()["replicas"] == [],
            90,
            show,
        )
        assert "zero" in pool.http.get("/api/v1/services/chat").json()["reason"]
        usage = pool.http.get("/api/v1/gateway/usage", params={"service": "chat"}).json()["items"]
        assert sum(u["requests"] for u in usage) >= 5 and sum(u["failed"] for u in usage) == 0
        gw.close()
