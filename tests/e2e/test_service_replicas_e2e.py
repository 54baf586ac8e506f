"""A model service's replicas run by a real agent (`cpool up`): the replica is a sandboxed process
of the tenant's user listening on the port the control plane chose, the service controller finds
it healthy, rolls it over to a new generation, and drains it when the service is deleted."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import httpx
from e2e_helpers import JOB_PYTHON, local_pool, wait_for

ENGINE = textwrap.dedent(
    """
    import http.server, json, os
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"port": os.environ["LISTEN"], "version": os.environ.get("V", "1")}).encode()
            self.send_response(200 if self.path == "/ready" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    http.server.ThreadingHTTPServer(("", int(os.environ["LISTEN"])), H).serve_forever()
    """
)


def spec(**request: Any) -> dict[str, Any]:
    return {
        "spec": {
            "request": {"command": [JOB_PYTHON, "-c", ENGINE], "cpu_milli": 200, **request},
            "port_env": "LISTEN",
            "health_path": "/ready",
            "min_replicas": 1,
            "max_replicas": 1,
            "startup_grace_s": 120,
            "drain_s": 5,
        }
    }


def test_a_replica_runs_on_the_agent_is_rolled_over_and_drained(tmp_path: Path) -> None:
    with local_pool(tmp_path) as (env, pool):
        r = pool.http.put("/api/v1/services/web", json=spec())
        assert r.status_code == 201, r.text
        # beside it, a service whose engine exits 1 at once: its failures show what it wrote
        broken = spec(command=[JOB_PYTHON, "-c", "import sys; sys.exit('no model at /models/x')"])
        broken["spec"]["queue_timeout_s"] = 300
        assert pool.http.put("/api/v1/services/broken", json=broken).status_code == 201

        def ready(generation: int) -> dict[str, Any] | None:
            out = pool.http.get("/api/v1/services/web").json()
            reps = out["replicas"]
            ok = (
                len(reps) == 1 and reps[0]["replica_state"] == "ready" and reps[0]["generation"] == generation
            )
            return out if ok else None

        def show() -> str:
            return pool.http.get("/api/v1/services/web").text

        first = wait_for("a ready replica", lambda: ready(1), 90, show)["replicas"][0]
        answer = httpx.get(first["endpoint"] + "/ready", timeout=5).json()
        assert answer == {"port": first["endpoint"].rsplit(":", 1)[1], "version": "1"}
        alloc = pool.get(first["allocation_id"])
        assert alloc["state"] == "active" and alloc["name"] == "svc-web" and alloc["restartable"] is True

        r = pool.http.put("/api/v1/services/web", json=spec(env={"V": "2"}))
        assert r.status_code == 200 and r.json()["generation"] == 2, r.text
        second = wait_for("the new generation ready", lambda: ready(2), 90, show)["replicas"][0]
        assert second["allocation_id"] != first["allocation_id"]
        assert httpx.get(second["endpoint"] + "/ready", timeout=5).json()["version"] == "2"
        old = pool.get(first["allocation_id"])
        assert old["state"] == "released" and old["reason"] == "replaced by generation 2", old

        said = 'stderr: "no model at /models/x"'

        def broken_said() -> str | None:
            why = str(pool.http.get("/api/v1/services/broken").json()["reason"])
            return why if said in why else None

        reason = wait_for("the broken engine's words", broken_said, 60)
        assert "failed (exited 1" in reason, reason
        # the gateway answers at once (each try gives up long before queue_timeout_s), with why
        gw = httpx.Client(base_url=pool.url, verify=pool.verify, timeout=5,
                          headers={"Authorization": f"Bearer {env['CPOOL_TOKEN']}"})  # fmt: skip
        body = {"model": "broken", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

        def refused() -> httpx.Response | None:
            got = gw.post("/v1/chat/completions", json=body)
            return got if got.status_code == 503 else None

        with gw:
            answer = wait_for("a 503 at once", refused, 60)
        assert said in answer.json()["error"]["message"], answer.text

        assert pool.http.delete("/api/v1/services/web").status_code == 200
        wait_for("the replica drained", lambda: pool.state(second["allocation_id"]) == "released", 30, show)
        assert pool.get(second["allocation_id"])["reason"] == "drained: service deleted"
        assert pool.http.get("/api/v1/services/web").status_code == 404
