"""The per-tenant API rate limit: a token bucket per tenant (`--api-rate`, `--api-burst`), on the
process's own clock, which the tests move by hand. One tenant over it gets 429 with Retry-After;
other tenants, nodes, admins and the health checks are not touched."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness import Api

from computepool.server.limits import TokenBuckets

A = "/api/v1/allocations"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def limited(make_api: Callable[..., Any], **settings: Any) -> tuple[Api, Clock]:
    api: Api = make_api(**settings)
    clock = Clock()
    api.app.state.api_limits = TokenBuckets(clock)
    api.app.state.caches.tokens.now = clock  # a known token stays cached however slow the host is
    return api, clock


def test_a_tenant_over_its_rate_gets_429_and_the_others_do_not(make_api: Callable[..., Any]) -> None:
    api, clock = limited(make_api, api_rate_per_s=2, api_burst=3)
    api.tenant("busy")
    api.tenant("calm")
    busy, busy2 = api.user("b1", "busy", "member"), api.user("b2", "busy", "viewer")
    calm = api.user("c1", "calm", "member")
    node = api.join_node("n1")
    assert [api.get(A, headers=busy).status_code for _ in range(3)] == [200] * 3
    over = api.get(A, headers=busy2)  # the tenant's bucket: any of its users
    assert over.status_code == 429 and over.headers["Retry-After"] == "1", over.text
    assert "tenant 'busy' is over its API rate limit (2 requests a second, 3 at once)" in over.json()["error"]
    assert [api.get(A, headers=calm).status_code for _ in range(3)] == [200] * 3
    for _ in range(20):  # nodes, admins and health checks take nothing from any bucket
        assert api.post("/api/v1/nodes/n1/heartbeat", headers=node).status_code == 200
        assert api.get(A, headers=api.admin).status_code == 200
        assert api.get("/healthz").status_code == 200
    clock.t += 0.5  # one token back
    assert api.get(A, headers=busy).status_code == 200
    assert api.get(A, headers=busy).status_code == 429
    clock.t += 10  # refilled, up to the burst only
    assert [api.get(A, headers=busy).status_code for _ in range(4)] == [200, 200, 200, 429]
    assert api.get(A, headers=calm).status_code == 200


def test_a_rate_of_zero_is_no_limit(make_api: Callable[..., Any]) -> None:
    api, _ = limited(make_api, api_rate_per_s=0, api_burst=1)
    api.tenant("t")
    who = api.user("u", "t", "member")
    assert {api.get(A, headers=who).status_code for _ in range(10)} == {200}


def test_token_buckets_wait_and_refill() -> None:
    clock = Clock()
    b = TokenBuckets(clock)
    assert [b.take("k", 4.0, 2.0) for _ in range(2)] == [None, None]
    assert b.take("k", 4.0, 2.0) == 0.25
    clock.t += 0.25
    assert b.take("k", 4.0, 2.0) is None
    assert b.take("other", 4.0, 2.0) is None
    b.forget({"other"})
    assert b.take("k", 4.0, 2.0) is None  # forgotten: full again


def test_made_up_tokens_from_one_address_get_429_before_any_lookup(make_api: Callable[..., Any]) -> None:
    api, clock = limited(make_api, auth_fail_rate_per_s=1, auth_fail_burst=3)
    api.tenant("t")
    known = api.user("u", "t", "member")
    assert api.get(A, headers=known).status_code == 200  # its token is known (cached) from now on
    bad = {"Authorization": "Bearer 999.made-up"}
    assert [api.get(A, headers=bad).status_code for _ in range(3)] == [401] * 3
    over = api.get(A, headers=bad)
    assert over.status_code == 429 and over.headers["Retry-After"] == "1", over.text
    assert "too many failed authentications from this address (1 a second, 3 at once)" in over.json()["error"]
    assert api.get(A, headers={"Authorization": "Bearer nonsense"}).status_code == 429  # malformed too
    assert api.get(A, headers=known).status_code == 200  # a known token still passes
    assert api.get("/healthz").status_code == 200
    assert api.get(A).status_code == 401  # no token at all: no lookup, nothing to limit
    clock.t += 1.0  # one failure more may be tried
    assert [api.get(A, headers=bad).status_code for _ in range(2)] == [401, 429]
    clock.t += 60
    late = api.user("u2", "t", "member")  # a token never used before: looked up once the rate allows
    assert api.get(A, headers=late).status_code == 200


def test_an_auth_fail_rate_of_zero_is_no_limit(make_api: Callable[..., Any]) -> None:
    api, _ = limited(make_api, auth_fail_rate_per_s=0, auth_fail_burst=1)
    bad = {"Authorization": "Bearer 999.made-up"}
    assert {api.get(A, headers=bad).status_code for _ in range(10)} == {401}
