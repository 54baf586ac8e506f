"""Bad input gets a 4xx that names the field — never a 500 — and nothing stored is lost."""

from __future__ import annotations

import json
from typing import Any

import pytest
from harness import Api
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

DEVICE = {"index": 0, "vendor": "nvidia", "model": "A100", "memory_mib": 40960}
NODE = {"join_token": "x", "name": "n", "cpu_milli": 1, "memory_mib": 1}

# (method, path, body, field named in the answer)
CASES: list[tuple[str, str, Any, str]] = [
    ("POST", "/api/v1/tenants", {"name": "ok", "weight": -1}, "weight"),
    ("POST", "/api/v1/tenants", {"name": "ok", "weight": 1e300}, "weight"),
    ("POST", "/api/v1/tenants", {"name": "ok", "weight": "heavy"}, "weight"),
    ("POST", "/api/v1/tenants", {"name": "Bad Name!"}, "name"),
    ("POST", "/api/v1/tenants", {"name": "x" * 64}, "name"),
    ("POST", "/api/v1/tenants", {"name": "ok", "colour": "red"}, "colour"),
    ("POST", "/api/v1/tenants", {}, "name"),
    ("POST", "/api/v1/tenants", [], "body"),
    ("POST", "/api/v1/users", {"name": "u", "tenant": "nosuch", "role": "member"}, "tenant"),
    ("POST", "/api/v1/users", {"name": "u", "tenant": "a", "role": "god"}, "role"),
    ("POST", "/api/v1/tokens", {"user": "nosuch"}, "user"),
    ("POST", "/api/v1/tokens", {"expires_in_s": -5}, "expires_in_s"),
    ("POST", "/api/v1/tokens", {"expires_in_s": 1.5}, "expires_in_s"),
    ("POST", "/api/v1/tokens", {"expires_in_s": True}, "expires_in_s"),
    ("POST", "/api/v1/tokens", {"expires_in_s": 10**30}, "expires_in_s"),
    ("POST", "/api/v1/join-tokens", {"expires_in_s": 0}, "expires_in_s"),
    ("POST", "/api/v1/join-tokens", {"single_use": "yes"}, "single_use"),
    ("PUT", "/api/v1/tenants/a/quota", {"gpu_milli": {"guaranteed": 5, "limit": 1}}, "gpu_milli"),
    ("PUT", "/api/v1/tenants/a/quota", {"gpu_milli": {"guaranteed": -1, "limit": 1}}, "gpu_milli.guaranteed"),
    ("PUT", "/api/v1/tenants/a/quota", {"cpu_milli": {"guaranteed": 0, "limit": 10**40}}, "cpu_milli.limit"),
    ("PUT", "/api/v1/tenants/a/quota", {"gpus": {"guaranteed": 0, "limit": 1}}, "gpus"),
    ("PUT", "/api/v1/tenants/a/quota", {"models": {"A100": {"cpu_milli": {}}}}, "models.A100.cpu_milli"),
    ("PUT", "/api/v1/tenants/a/quota", {"models": {"bad model": {}}}, "models.bad model.[key]"),
    ("PUT", "/api/v1/tenants/nosuch/quota", {}, ""),
    # the pool's own job variables (a function worker's token, the allocation's id) are not the user's
    ("POST", "/api/v1/allocations", {"command": ["true"], "env": {"CPOOL_WORKER_TOKEN": "x"}}, "env"),
    ("POST", "/api/v1/allocations", {"command": ["true"], "env": {"CPOOL_ALLOCATION_ID": "7"}}, "env"),
    (
        "POST",
        "/api/v1/nodes/join",
        {"join_token": "x", "name": "n", "cpu_milli": -1, "memory_mib": 1},
        "cpu_milli",
    ),
    (
        "POST",
        "/api/v1/nodes/join",
        {
            "join_token": "x",
            "name": "n",
            "cpu_milli": 1,
            "memory_mib": 1,
            "devices": [{**DEVICE, "memory_mib": 0}],
        },
        "devices[0].memory_mib",
    ),
    (
        "POST",
        "/api/v1/nodes/join",
        {**NODE, "devices": [DEVICE, DEVICE]},
        "body",
    ),
    ("GET", "/api/v1/audit?since=yesterday", None, "since"),
    ("GET", "/api/v1/audit?limit=0", None, "limit"),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), CASES, ids=[f"{c[1]}:{c[3]}" for c in CASES])
def test_bad_input_is_a_4xx_naming_the_field(api: Api, method: str, path: str, body: Any, field: str) -> None:
    api.tenant("a")
    r = api.request(method, path, headers=api.admin, json=body)
    assert 400 <= r.status_code < 500, r.text
    doc = r.json()
    assert isinstance(doc["error"], str) and doc["error"]
    if field and field != "body":
        assert doc["field"].startswith(field) or field in doc["field"], doc
    # nothing stored was lost
    assert [t["name"] for t in api.ok("GET", "/api/v1/tenants")["items"]] == ["a", "default"]


def test_malformed_json_and_wrong_content(api: Api) -> None:
    for raw in (b"{", b"{'name': 'a'}", b"\xff\xfe", b"null", b"", b'{"name": "a", "weight": NaN}'):
        r = api.post(
            "/api/v1/tenants", content=raw, headers={**api.admin, "Content-Type": "application/json"}
        )
        assert r.status_code == 422, (raw, r.text)
        assert r.json()["field"] in ("body", "weight")
    r = api.post("/api/v1/tenants", content=b"name=a", headers={**api.admin, "Content-Type": "text/plain"})
    assert 400 <= r.status_code < 500


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=12,
)
FIELDS = ["name", "weight", "tenant", "role", "user", "expires_in_s", "single_use", "join_token", "cpu_milli"]
FIELDS += ["memory_mib", "devices", "labels", "gpu_milli", "models", "devices_usage", "guaranteed", "limit"]
bodies = st.one_of(json_values, st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6))
ENDPOINTS = [
    ("POST", "/api/v1/tenants"),
    ("POST", "/api/v1/users"),
    ("POST", "/api/v1/tokens"),
    ("POST", "/api/v1/join-tokens"),
    ("PUT", "/api/v1/tenants/a/quota"),
    ("POST", "/api/v1/nodes/join"),
]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(endpoint=st.sampled_from(ENDPOINTS), body=bodies)
def test_fuzzed_bodies_never_500(api: Api, endpoint: tuple[str, str], body: Any) -> None:
    method, path = endpoint
    r = api.request(method, path, headers=api.admin, content=json.dumps(body), params=None)
    assert r.status_code < 500, (method, path, body, r.text)
    if r.status_code >= 400:
        assert "error" in r.json()
