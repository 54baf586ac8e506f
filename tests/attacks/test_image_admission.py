"""Which image a tenant's job may name, through the real API: registry names only, published ones.

A tenant once ran `--image docker-archive:<its own file>` and the root agent loaded the archive,
whose tags then renamed another tenant's image on the node. Now every transport is refused at the
edge (422 naming `image`), a tenant runs only what an admin published to it (or an allowed
registry's images), and the request is pinned to the published image id at admission.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import Api

A = "sha256:" + "a" * 64
B = "sha256:" + "b" * 64
TRANSPORTS = [
    "docker-archive:/var/tmp/x.tar",
    "docker-archive:x.tar:localhost/pybase:1",
    "oci-archive:/var/tmp/x.tar",
    "oci:/var/tmp/layout",
    "oci:latest",
    "dir:/root",
    "containers-storage:localhost/pybase:1",
    "containers-storage:[overlay@/var/lib/containers/storage]localhost/pybase:1",
    "docker://localhost/pybase:1",
    "docker-daemon:alpine:latest",
    "sif:/var/tmp/x.sif",
    "ostree:x@/ostree/repo",
    "tarball:/var/tmp/x.tar",
    "/root/.computepool/admin-token",
    "../../etc/passwd",
    "--privileged",
]


def _tenants(api: Api) -> tuple[dict[str, str], dict[str, str]]:
    api.tenant("ta")
    api.tenant("tb")
    return api.user("ua", "ta", "member"), api.user("ub", "tb", "member")


def _submit(api: Api, who: dict[str, str], image: str) -> Any:
    return api.post(
        "/api/v1/allocations", json={"command": ["true"], "cpu_milli": 100, "image": image}, headers=who
    )


@pytest.mark.parametrize("image", TRANSPORTS)
def test_a_transport_or_a_path_is_refused_at_the_edge(api: Api, image: str) -> None:
    a, _ = _tenants(api)
    r = _submit(api, a, image)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "image", r.text
    assert "registry" in r.json()["error"] or "transport" in r.json()["error"], r.text


def test_an_unpublished_image_is_refused_and_another_tenants_looks_just_like_it(api: Api) -> None:
    a, b = _tenants(api)
    api.ok("POST", "/api/v1/images", json={"name": "localhost/secret-b:1", "digest": B, "tenants": ["tb"]})
    theirs = _submit(api, a, "localhost/secret-b:1")
    missing = _submit(api, a, "localhost/secret-c:1")
    assert theirs.status_code == missing.status_code == 422
    assert theirs.json()["field"] == missing.json()["field"] == "image"
    assert theirs.text.replace("secret-b", "X") == missing.text.replace("secret-c", "X")
    # …and a present-on-the-node image nobody published is refused too
    assert _submit(api, a, "localhost/pybase:1").status_code == 422
    assert _submit(api, b, "localhost/secret-b:1").status_code == 201
    # a tenant's list shows only its own images, naming only itself
    assert api.ok("GET", "/api/v1/images", headers=a)["items"] == []
    [mine] = api.ok("GET", "/api/v1/images", headers=b)["items"]
    assert mine["tenants"] == ["tb"] and mine["digest"] == B


def test_the_request_is_pinned_at_admission_and_republishing_moves_only_later_jobs(api: Api) -> None:
    a, _ = _tenants(api)
    api.ok("POST", "/api/v1/images", json={"name": "localhost/app:1", "digest": A})
    first = _submit(api, a, "localhost/app:1").json()
    assert first["request"]["image_digest"] == A
    api.ok("POST", "/api/v1/images", json={"name": "localhost/app:1", "digest": B})
    second = _submit(api, a, "localhost/app:1").json()
    assert second["request"]["image_digest"] == B
    assert api.ok("GET", f"/api/v1/allocations/{first['id']}", headers=a)["request"]["image_digest"] == A
    # the audit record of each submission names the image id it will run
    records = api.ok("GET", "/api/v1/audit?action=allocation.create")["items"]
    pinned = {r["target"]: r["detail"]["request"]["image_digest"] for r in records}
    assert pinned == {f"allocation:{first['id']}": A, f"allocation:{second['id']}": B}


def test_short_names_mean_docker_io_and_are_pinned_as_published(api: Api) -> None:
    a, _ = _tenants(api)
    out = api.ok("POST", "/api/v1/images", json={"name": "python:3.12", "digest": A})
    assert out["name"] == "docker.io/library/python:3.12"
    assert _submit(api, a, "docker.io/library/python:3.12").json()["request"]["image_digest"] == A
    short = _submit(api, a, "library/python:3.12").json()
    assert short["request"]["image"] == "docker.io/library/python:3.12"
    assert _submit(api, a, "localhost/python:3.12").status_code == 422


def test_only_an_admin_publishes_and_bad_publications_are_refused(api: Api) -> None:
    a, _ = _tenants(api)
    body = {"name": "localhost/x:1", "digest": A}
    assert api.post("/api/v1/images", json=body, headers=a).status_code == 403
    assert api.delete("/api/v1/images", params={"name": "localhost/x:1"}, headers=a).status_code == 403
    for bad, field in (
        ({"name": "oci:/x", "digest": A}, "name"),
        ({"name": "localhost/x:1", "digest": "sha256:12"}, "digest"),
        ({"name": "localhost/x:1", "digest": A, "tenants": ["nobody"]}, "tenants.0"),
        ({"name": "localhost/x:1", "digest": A, "extra": 1}, "extra"),
    ):
        r = api.post("/api/v1/images", json=bad, headers=api.admin)
        assert r.status_code in (404, 422) and field in r.text, (bad, r.text)
    assert api.ok("GET", "/api/v1/images")["items"] == []


def test_unpublishing_refuses_new_jobs(api: Api) -> None:
    a, _ = _tenants(api)
    api.ok("POST", "/api/v1/images", json={"name": "localhost/x:1", "digest": A})
    assert _submit(api, a, "localhost/x:1").status_code == 201
    api.ok("DELETE", "/api/v1/images", params={"name": "localhost/x:1"})
    assert _submit(api, a, "localhost/x:1").status_code == 422
    gone = api.delete("/api/v1/images", params={"name": "localhost/x:1"}, headers=api.admin)
    assert gone.status_code == 404
    bad = api.delete("/api/v1/images", params={"name": "oci:/x"}, headers=api.admin)
    assert bad.status_code == 422 and bad.json()["field"] == "name", bad.text


def test_an_allowed_registry_needs_no_publication_and_nothing_else_rides_on_it(make_api: Any) -> None:
    api: Api = make_api(allowed_registries=("127.0.0.1:5000", "ghcr.io/acme"))
    a, _ = _tenants(api)
    ok = _submit(api, a, "127.0.0.1:5000/team/app:2").json()
    assert ok["request"]["image"] == "127.0.0.1:5000/team/app:2" and ok["request"].get("image_digest") is None
    assert _submit(api, a, "ghcr.io/acme/tool:1").status_code == 201
    assert _submit(api, a, "ghcr.io/acmeevil/tool:1").status_code == 422
    assert _submit(api, a, "127.0.0.1:5001/team/app:2").status_code == 422
