"""The OpenAI-compatible gateway: authentication, routing, usage, rate limits, on SQLite and PostgreSQL.

Replicas are real simulated engines on loopback, registered in the database as the service
controller would (gateway_kit.py). Streaming, queueing and several gateways are in
test_gateway_processes.py, against real `cpool gateway` processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from conftest import Api
from gateway_kit import Registry, engine, wait_until

from computepool.server.logic.service_load import Load, fresh_load, write_load
from computepool.store.models import Service

H = dict[str, str]


@dataclass
class Pool:
    api: Api
    reg: Registry
    alice: H  # member of t1
    carol: H  # viewer of t1
    bob: H  # member of t2


@pytest.fixture
def pool(api: Api) -> Pool:
    api.tenant("t1")
    api.tenant("t2")
    alice = api.user("alice", "t1", "member")
    carol = api.user("carol", "t1", "viewer")
    bob = api.user("bob", "t2", "member")
    return Pool(api, Registry(api.app.state.db), alice, carol, bob)


def chat(model: str, text: str = "hello there", max_tokens: int = 5, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        **extra,
    }


def complete(api: Api, model: str, headers: H) -> httpx.Response:
    return api.post("/v1/completions", json={"model": model, "prompt": "x"}, headers=headers)


def oa_error(r: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI-style error body, checked for shape."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code"} and err["message"], err
    return dict(err)


def test_models_authentication_and_errors(pool: Pool) -> None:
    api = pool.api
    with engine(model="e1") as port:
        sid = pool.reg.service("t1", "echo")
        pool.reg.replica(sid, port)
        pool.reg.service("t2", "other")

        models = api.get("/v1/models", headers=pool.alice).json()
        assert models["object"] == "list"
        assert [(m["id"], m["object"], m["owned_by"]) for m in models["data"]] == [("echo", "model", "t1")]
        assert [m["id"] for m in api.get("/v1/models", headers=pool.bob).json()["data"]] == ["other"]
        assert [m["id"] for m in api.get("/v1/models", headers=pool.carol).json()["data"]] == ["echo"]
        admin_ids = {m["id"] for m in api.get("/v1/models", headers=api.admin).json()["data"]}
        assert admin_ids == {"t1/echo", "t2/other"}

        # no token, a malformed one, a wrong secret: 401 in OpenAI's shape
        assert oa_error(api.post("/v1/chat/completions", json=chat("echo")), 401)["code"] == "invalid_api_key"
        oa_error(api.get("/v1/models", headers={"Authorization": "Bearer nonsense"}), 401)
        token = pool.alice["Authorization"].split()[1]
        wrong = {"Authorization": f"Bearer {token.split('.')[0]}.{'x' * 43}"}
        oa_error(api.post("/v1/chat/completions", json=chat("echo"), headers=wrong), 401)
        # a viewer reads the models but may not use them; a node's credential may do neither
        assert (
            "may not gateway.use"
            in oa_error(api.post("/v1/chat/completions", json=chat("echo"), headers=pool.carol), 403)[
                "message"
            ]
        )
        node = api.join_node("n-gw", devices=0)
        oa_error(api.post("/v1/chat/completions", json=chat("echo"), headers=node), 403)
        oa_error(api.get("/v1/models", headers=node), 403)

        # another tenant's service answers exactly like a missing one
        theirs = oa_error(api.post("/v1/chat/completions", json=chat("other"), headers=pool.alice), 404)
        missing = oa_error(api.post("/v1/chat/completions", json=chat("nope"), headers=pool.alice), 404)
        assert theirs["message"] == "model 'other' not found"
        assert missing["message"] == "model 'nope' not found" and theirs["code"] == missing["code"]
        oa_error(api.post("/v1/chat/completions", json=chat("t2/other"), headers=pool.alice), 404)

        bad = api.post("/v1/completions", content=b"{not json", headers=pool.alice)
        assert "JSON" in oa_error(bad, 400)["message"]
        assert oa_error(api.post("/v1/completions", json={"prompt": "x"}, headers=pool.alice), 400)[
            "message"
        ].startswith("model:")
        oa_error(api.post("/v1/completions", json=["echo"], headers=pool.alice), 400)

        # a good request: the engine's own answer, passed back (its status too)
        direct = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat("echo")).json()
        got = api.post("/v1/chat/completions", json=chat("echo"), headers=pool.alice)
        assert got.status_code == 200, got.text
        assert got.json()["choices"] == direct["choices"] and got.json()["usage"] == direct["usage"]
        assert got.json()["model"] == "e1"
        engine_400 = api.post("/v1/completions", json={"model": "echo", "prompt": 3}, headers=pool.alice)
        assert engine_400.status_code == 400 and "prompt" in engine_400.json()["error"]["message"]
        # admins name another tenant's service as tenant/name
        as_admin = api.post("/v1/chat/completions", json=chat("t1/echo"), headers=api.admin)
        assert as_admin.status_code == 200 and as_admin.json()["choices"] == direct["choices"]


def test_usage_sums_the_engines_token_counts(pool: Pool) -> None:
    api = pool.api
    with engine() as port:
        sid = pool.reg.service("t1", "counted")
        pool.reg.replica(sid, port)
        prompt = completion = 0
        bodies = [
            ("/v1/completions", {"model": "counted", "prompt": "one two three", "max_tokens": 7}),
            ("/v1/completions", {"model": "counted", "prompt": "four", "max_tokens": 2}),
            ("/v1/chat/completions", chat("counted", "a b c d e", max_tokens=3)),
            ("/v1/embeddings", {"model": "counted", "input": ["x y", "z"]}),
        ]
        for path, body in bodies:
            r = api.post(path, json=body, headers=pool.alice)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            prompt += usage["prompt_tokens"]
            completion += usage.get("completion_tokens", 0)
        assert prompt > 0 and completion == 12

        def rows() -> list[dict[str, Any]]:
            got = api.get("/api/v1/gateway/usage", headers=pool.alice, params={"service": "counted"})
            assert got.status_code == 200, got.text
            items: list[dict[str, Any]] = got.json()["items"]
            return items if sum(i["requests"] for i in items) == len(bodies) else []

        (row,) = wait_until(rows, 15, "usage to be flushed")
        token_id = pool.alice["Authorization"].split()[1].split(".")[0]
        assert (row["tenant"], row["user"], row["token_id"], row["service"]) == (
            "t1",
            "alice",
            token_id,
            "counted",
        )
        assert (row["prompt_tokens"], row["completion_tokens"], row["failed"]) == (prompt, completion, 0)
        hour = datetime.fromisoformat(row["hour"])
        assert hour.minute == 0 and abs(datetime.now(UTC) - hour) < timedelta(hours=1, minutes=1)
        # the tenant's rows only: bob sees none of t1's, nor may he ask for them
        assert api.get("/api/v1/gateway/usage", headers=pool.bob).json()["items"] == []
        assert api.get("/api/v1/gateway/usage", headers=pool.bob, params={"tenant": "t1"}).status_code == 404
        as_admin = api.get("/api/v1/gateway/usage", headers=api.admin, params={"tenant": "t1", "since": "1h"})
        assert [r["requests"] for r in as_admin.json()["items"]] == [len(bodies)]
        future = (datetime.now(UTC) + timedelta(hours=2)).isoformat()
        assert api.get("/api/v1/gateway/usage", headers=pool.alice, params={"since": future}).json() == {
            "items": []
        }
        bad = api.get("/api/v1/gateway/usage", headers=pool.alice, params={"since": "yesterday"})
        assert bad.status_code == 422 and bad.json()["field"] == "since"


def test_rate_limit_answers_429_with_retry_after(pool: Pool) -> None:
    api = pool.api
    path = "/api/v1/tenants/t1/gateway-limit"
    assert api.put(path, json={"requests_per_minute": 60}, headers=pool.alice).status_code == 403
    bad = api.put(path, json={"requests_per_minute": 0}, headers=api.admin)
    assert bad.status_code == 422 and bad.json()["field"] == "requests_per_minute"
    assert api.put(path, json={"requests_per_minute": 60, "extra": 1}, headers=api.admin).status_code == 422
    assert api.get(path, headers=pool.alice).status_code == 404  # none yet
    assert api.ok("PUT", path, json={"requests_per_minute": 600}) == {
        "tenant": "t1", "requests_per_minute": 600, "burst": 100,
    }  # fmt: skip
    limit = api.ok("PUT", path, json={"requests_per_minute": 60, "burst": 2})
    assert limit == {"tenant": "t1", "requests_per_minute": 60, "burst": 2}
    assert api.get(path, headers=pool.alice).json() == limit
    assert api.get(path, headers=pool.bob).status_code == 404  # another tenant's
    assert (
        api.put(
            "/api/v1/tenants/nope/gateway-limit", json={"requests_per_minute": 5}, headers=api.admin
        ).status_code
        == 404
    )
    with engine() as port:
        sid = pool.reg.service("t1", "limited")
        pool.reg.replica(sid, port)
        pool.reg.service("t2", "free", queue_timeout_s=1)
        wait_until(lambda: complete(api, "limited", pool.alice).status_code == 429,
                   10, "the limit to be read")  # fmt: skip
        r = complete(api, "limited", pool.alice)
        err = oa_error(r, 429)
        assert err["code"] == "rate_limit_exceeded" and "t1" in err["message"]
        assert int(r.headers["Retry-After"]) >= 1
        # another tenant is not held back (no replica: it waits its queue timeout, then 503, never 429)
        other = complete(api, "free", pool.bob)
        assert oa_error(other, 503)["message"] == "no replica of service 'free' became free within 1 s"
        time.sleep(1.2)  # the bucket refills at one a second
        assert (
            api.post(
                "/v1/completions", json={"model": "limited", "prompt": "x"}, headers=pool.alice
            ).status_code
            == 200
        )
        assert api.delete(path, headers=pool.alice).status_code == 403
        assert api.delete(path, headers=api.admin).status_code == 204
        assert api.get(path, headers=api.admin).status_code == 404
        assert api.delete(path, headers=api.admin).status_code == 404

        def unlimited() -> bool:
            codes = [complete(api, "limited", pool.alice).status_code for _ in range(4)]
            return codes == [200] * 4

        wait_until(unlimited, 10, "the limit to be lifted")
        audit = api.ok("GET", "/api/v1/audit", params={"action": "gateway.limit.set"})
        assert len([e for e in audit["items"] if e["target"] == "gateway-limit:t1"]) >= 3


def test_load_reports_sum_fresh_gateways(pool: Pool) -> None:
    db = pool.api.app.state.db
    sid = pool.reg.service("t1", "loaded")
    other = pool.reg.service("t1", "quiet")
    with db.write() as s:
        now = datetime.now(UTC)
        write_load(s, "gw-a", {sid: Load(3, 1, {11: 2, 12: 1})}, {sid: 40}, now)
        write_load(s, "gw-b", {sid: Load(2, 4, {12: 2}), other: Load(0, 0, {})}, {sid: 7}, now)
        write_load(s, "gw-old", {sid: Load(50, 50, {11: 50})}, {}, now - timedelta(seconds=10))
        write_load(s, "gw-gone", {other: Load(9, 9, {})}, {}, now - timedelta(seconds=90))
    with db.write() as s:
        got = fresh_load(s, [sid, other, 9999], datetime.now(UTC))
        assert got[sid] == Load(5, 5, {11: 2, 12: 3})  # gw-old is stale: ignored
        assert got[other] == Load(0, 0, {}) and 9999 not in got
        assert fresh_load(s, [sid], datetime.now(UTC), max_age_s=1000)[sid].inflight == 55
        # a gateway's next report replaces its rows; services it no longer reports are dropped
        write_load(s, "gw-b", {sid: Load(1, 0, {12: 1})}, {sid: 9}, datetime.now(UTC))
    rows = {(r.gateway, r.service_id): r for r in pool.reg.loads(sid) + pool.reg.loads(other)}
    assert ("gw-b", other) not in rows and ("gw-gone", other) not in rows  # older than a minute: deleted
    assert rows[("gw-b", sid)].requests == 9 and rows[("gw-b", sid)].replicas == {"12": 1}
    assert rows[("gw-a", sid)].requests == 40


def test_gateway_reports_its_load_and_touches_the_service(pool: Pool) -> None:
    api = pool.api
    with engine() as port:
        sid = pool.reg.service("t1", "reported")
        alloc = pool.reg.replica(sid, port)
        for _ in range(3):
            assert (
                api.post(
                    "/v1/completions", json={"model": "reported", "prompt": "x"}, headers=pool.alice
                ).status_code
                == 200
            )

        def report() -> Any:
            rows = [r for r in pool.reg.loads(sid) if r.gateway == api.app.state.gateway.id]
            return rows[0] if rows and rows[0].requests == 3 else None

        row = wait_until(report, 10, "the load report")
        assert (row.inflight, row.queued, row.replicas) == (0, 0, {str(alloc): 0})
        with pool.reg.db.read() as s:
            svc = s.get(Service, sid)
            assert svc is not None and svc.last_request_at is not None
            assert abs(datetime.now(UTC) - svc.last_request_at) < timedelta(seconds=30)


def test_a_service_whose_replicas_fail_is_answered_503_at_once_with_why(pool: Pool) -> None:
    api, reg = pool.api, pool.reg
    sid = reg.service("t1", "broken", queue_timeout_s=120)
    why = 'replica 7 failed (exited 1 on n1; stderr: "no such model"): replaced'
    with api.app.state.db.write() as s:
        row = s.get(Service, sid)
        assert row is not None
        row.reason = f"1 replica (min_replicas); {why}"
    # a request already waiting when the failure is recorded waits its queue out: ask once the
    # gateway's table (re-read every 0.5 s) has it
    gateway = api.app.state.gateway
    wait_until(lambda: (gateway.service_info(sid) or SimpleNamespace(failing="")).failing, what="the table")
    r = api.post("/v1/chat/completions", json=chat("broken"), headers=pool.alice)
    err = oa_error(r, 503)  # at once: the queue would have waited 120 s
    assert err["code"] == "replicas_failing" and why in err["message"], err
    with engine("broken") as port:  # a ready replica again: requests go to it, failures or not
        reg.replica(sid, port)

        def ask() -> httpx.Response:
            return api.post("/v1/chat/completions", json=chat("broken"), headers=pool.alice)

        wait_until(lambda: ask().status_code == 200, what="the ready replica answers")


def test_a_replicas_answer_is_never_sniffed_nor_run_as_a_page(pool: Pool) -> None:
    """A replica's bytes come from the pool's own origin (the dashboard's): whatever type it claims,
    the browser neither guesses another nor runs it as a page (no script, no same-origin access)."""
    with engine() as port:
        pool.reg.replica(pool.reg.service("t1", "framed"), port)
        r = pool.api.post("/v1/chat/completions", json=chat("framed"), headers=pool.alice)
        assert r.status_code == 200, r.text
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["content-security-policy"].split(";")[0] == "sandbox"
        streamed = pool.api.post("/v1/chat/completions", json=chat("framed", stream=True), headers=pool.alice)
        assert streamed.status_code == 200 and streamed.headers["x-content-type-options"] == "nosniff"
