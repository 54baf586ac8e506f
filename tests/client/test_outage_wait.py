"""How long followers wait for a control plane that is away is a setting: `cpool --outage-wait`,
CPOOL_OUTAGE_WAIT, the SDK's `Pool(outage_wait=...)`; 15 minutes when unset."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from computepool.client.follow import OUTAGE_S, outage_wait_s
from computepool.core.errors import InvalidInput
from computepool.sdk import Pool


def test_the_wait_is_read_as_a_duration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CPOOL_OUTAGE_WAIT", raising=False)
    assert outage_wait_s() == OUTAGE_S == 900.0
    monkeypatch.setenv("CPOOL_OUTAGE_WAIT", "1h30m")
    assert outage_wait_s() == 5400.0
    assert outage_wait_s("45s") == 45.0 and outage_wait_s(20) == 20.0  # given beats the environment
    assert outage_wait_s("0") == 0.0
    with pytest.raises(InvalidInput, match=r"^outage_wait: cannot read duration 'soon'"):
        outage_wait_s("soon", "outage_wait")
    monkeypatch.setenv("CPOOL_OUTAGE_WAIT", "-5m")
    with pytest.raises(InvalidInput, match="^CPOOL_OUTAGE_WAIT: "):
        outage_wait_s()
    assert Pool("http://127.0.0.1:9", "a.b", outage_wait="2m").rider.outage_s == 120.0
    with pytest.raises(InvalidInput, match="^outage_wait: "):
        Pool("http://127.0.0.1:9", "a.b", outage_wait="later")


def _dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on: every connection is refused
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _cpool(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CPOOL_")}
    base |= {"CPOOL_SERVER": _dead_url(), "CPOOL_TOKEN": "a.b", "CPOOL_CONFIG": str(tmp_path / "c.json")}
    argv = [sys.executable, "-m", "computepool.cli.main", *args]
    return subprocess.run(argv, env=base | (env or {}), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("how", ["option", "env"])
def test_a_follower_gives_up_once_the_wait_is_over(tmp_path: Path, how: str) -> None:
    if how == "option":
        r = _cpool(tmp_path, "--outage-wait", "1s", "logs", "-f", "7")
    else:
        r = _cpool(tmp_path, "logs", "-f", "7", env={"CPOOL_OUTAGE_WAIT": "1s"})
    assert r.returncode == 1, r.stderr
    assert "cannot reach the pool server" in r.stderr and "Traceback" not in r.stderr


def test_a_wait_that_is_no_duration_is_one_line(tmp_path: Path) -> None:
    r = _cpool(tmp_path, "--outage-wait", "soon", "ps")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: --outage-wait: cannot read duration 'soon' (expected e.g. 90s, 15m, 2h, 1d) (how long to "
        "wait for a control plane that is away)"
    ]
