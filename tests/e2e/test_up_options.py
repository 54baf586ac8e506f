"""`cpool up` hands the server's admission options on: defaults, allowed registries, port ranges."""

from __future__ import annotations

from pathlib import Path

from e2e_helpers import local_pool


def test_cpool_up_passes_defaults_and_allowed_registries_to_its_server(tmp_path: Path) -> None:
    extra = (
        "--default-cpus", "0.5", "--default-mem", "256MiB", "--default-pids", "64",
        "--allowed-registries", "127.0.0.1:5999", "--publish-ports", "21000-21999",
    )  # fmt: skip
    with local_pool(tmp_path, extra=extra) as (_env, pool):
        r = pool.http.post("/api/v1/allocations", json={"command": ["true"]})
        assert r.status_code == 201, r.text
        request = r.json()["request"]
        assert (request["cpu_milli"], request["memory_mib"]) == (500, 256), request
        body = {"command": ["true"], "image": "127.0.0.1:5999/team/app:1", "ports": [21000]}
        assert pool.http.post("/api/v1/allocations", json=body).status_code == 201
        for refused in (
            {"image": "127.0.0.1:5998/app:1"},
            {"image": "127.0.0.1:5999/a:1", "ports": [20000]},
        ):
            r = pool.http.post("/api/v1/allocations", json={"command": ["true"], **refused})
            assert r.status_code == 422, r.text
