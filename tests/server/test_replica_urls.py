"""Each replica publishes where it is reached; join and heartbeat answers name the live replicas,
so an agent given one URL learns the others."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from harness import Api
from pydantic import ValidationError

from computepool.server.replicas import LIVE_FOR_S, own_url
from computepool.server.settings import ServerSettings
from computepool.store import replicas
from computepool.store.db import db_now


def test_own_url_comes_from_host_and_port_unless_a_wildcard(tmp_path: Path) -> None:
    def url(**kw: object) -> str | None:
        return own_url(ServerSettings(data_dir=tmp_path, **kw))  # type: ignore[arg-type]

    assert url(host="10.0.0.5", port=8470) == "http://10.0.0.5:8470"
    assert url(host="::1", port=9000) == "http://[::1]:9000"
    assert url(host="localhost", port=8470, tls_cert=tmp_path / "c.pem", tls_key=tmp_path / "k.pem") == (
        "https://localhost:8470"
    )
    assert url(host="0.0.0.0", port=8470) is None and url(host="::", port=8470) is None
    assert url(host="0.0.0.0", advertise_url="https://localhost:8470/") == "https://localhost:8470"
    with pytest.raises(ValidationError, match="advertise_url"):
        ServerSettings(data_dir=tmp_path, advertise_url="ftp://localhost")


def test_join_and_heartbeat_answers_name_the_live_replicas(make_api: Callable[..., Api]) -> None:
    api = make_api(host="127.0.0.1", port=18470)
    with api.app.state.db.write() as s:
        now = db_now(s)
        replicas.publish(s, "http://127.0.0.1:18471", now)
        replicas.publish(s, "http://127.0.0.1:18472", now - timedelta(seconds=LIVE_FOR_S * 3))  # gone
    api.app.state.replicas.step()
    node = api.join_node("n-urls")
    hb = api.ok("POST", "/api/v1/nodes/n-urls/heartbeat", headers=node, json={})
    assert hb["servers"] == ["http://127.0.0.1:18470", "http://127.0.0.1:18471"]
    api.app.state.replicas.withdraw()  # a clean stop: gone from the list at once
    with api.app.state.db.write() as s:
        assert replicas.live(s, db_now(s), LIVE_FOR_S) == ["http://127.0.0.1:18471"]
