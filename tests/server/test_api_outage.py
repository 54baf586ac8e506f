"""PostgreSQL goes away mid-run: 503 with Retry-After, liveness stays up, and recovery needs no restart."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi.testclient import TestClient
from harness import PgServer

from computepool.server import ServerSettings, create_app


def test_database_outage_gives_503_then_recovers(postgres: PgServer, tmp_path: Path) -> None:
    settings = ServerSettings(data_dir=tmp_path, db_url=postgres.new_database())
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        admin = {"Authorization": f"Bearer {settings.admin_token_path.read_text().strip()}"}
        assert client.post("/api/v1/tenants", json={"name": "a"}, headers=admin).status_code == 201
        postgres.stop("fast")
        try:
            r = client.get("/readyz")
            assert r.status_code == 503 and r.headers["retry-after"] == "2"
            for method, path, body in (
                ("GET", "/api/v1/tenants", None),
                ("POST", "/api/v1/tenants", {"name": "b"}),
                ("GET", "/api/v1/nodes", None),  # (whoami may come from the token cache)
            ):
                r = client.request(method, path, headers=admin, json=body)
                assert r.status_code == 503, (path, r.text)
                assert r.headers["retry-after"] == "2" and "database" in r.json()["error"]
            assert client.get("/healthz").status_code == 200
        finally:
            postgres.start()
        deadline = time.monotonic() + 10
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "server did not recover after the database came back"
            time.sleep(0.2)
        names = [t["name"] for t in client.get("/api/v1/tenants", headers=admin).json()["items"]]
        assert names == ["a", "default"]
        assert client.post("/api/v1/tenants", json={"name": "b"}, headers=admin).status_code == 201
        assert client.get("/api/v1/audit/verify", headers=admin).json()["ok"] is True
