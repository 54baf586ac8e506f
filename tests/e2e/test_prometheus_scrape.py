"""A real Prometheus scrapes a real pool (`cpool up --simulate`) with a scraper user's token over
HTTPS, loads the shipped rules, and sees a job's device busy; a member's token is refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from e2e_helpers import cpool, free_port, local_pool, sleeper, stop, wait_for

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "computepool-rules.yml"
DASHBOARD = DEPLOY / "grafana" / "computepool-dashboard.json"


def _prometheus() -> str:
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("prometheus is missing: `apt-get install prometheus` (CI installs it)", pytrace=False)
        pytest.skip("prometheus is not installed")
    return found


def _cli(env: dict[str, str], *args: str) -> str:
    r = subprocess.run(cpool(*args), env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _query(base: str, promql: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{base}/api/v1/query", params={"query": promql}, timeout=5)
    r.raise_for_status()
    return list(r.json()["data"]["result"])


def test_prometheus_scrapes_the_pool_with_a_scraper_token(tmp_path: Path) -> None:
    prometheus = _prometheus()
    with local_pool(tmp_path, "2xA100-80GB") as (env, pool):
        busy = pool.job(sleeper(60), gpus=1, gpu_milli=500)  # runs while the rest is set up
        # the scraper as docs/metrics.md makes it; a member through the API
        _cli(env, "users", "create", "prom", "--tenant", "default", "--role", "scraper")
        secrets = tmp_path / "secrets"
        secrets.mkdir(mode=0o700)
        (secrets / "scraper").write_text(_cli(env, "tokens", "create", "--user", "prom") + "\n")
        r = pool.http.post("/api/v1/users", json={"name": "bob", "tenant": "default", "role": "member"})
        assert r.status_code == 201, r.text
        r = pool.http.post("/api/v1/tokens", json={"user": "bob"})
        assert r.status_code == 201, r.text
        (secrets / "member").write_text(r.json()["token"] + "\n")
        target = env["CPOOL_SERVER"].removeprefix("https://")

        def job(name: str, token: str) -> dict[str, Any]:
            return {
                "job_name": name,
                "scheme": "https",
                "metrics_path": "/metrics",
                "authorization": {"type": "Bearer", "credentials_file": str(secrets / token)},
                "tls_config": {"ca_file": env["CPOOL_CA"]},
                "static_configs": [{"targets": [target]}],
            }

        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [job("computepool", "scraper"), job("computepool-member", "member")],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = tmp_path / "prometheus.log"
        with log.open("wb") as out:
            prom = subprocess.Popen(
                [
                    prometheus,
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_for("the job to run", lambda: pool.state(busy) == "active", 30)

            def up(name: str) -> float | None:
                got = _query(base, f'up{{job="{name}"}}')
                return float(got[0]["value"][1]) if got else None

            wait_for("the scrape", lambda: up("computepool") == 1.0, 30, log.read_text)
            # the job's device shows it busy: heartbeat → database → /metrics → Prometheus
            busy_dev = wait_for(
                "a busy device",
                lambda: _query(base, "cpool_device_utilization_percent > 0"),
                30,
                lambda: str(_query(base, "cpool_device_utilization_percent")),
            )
            assert [float(s["value"][1]) for s in busy_dev] == [50.0]
            (held,) = pool.get(busy)["slices"]
            assert busy_dev[0]["metric"]["device"] == str(held["device_index"])
            power = {
                s["metric"]["device"]: float(s["value"][1]) for s in _query(base, "cpool_device_power_watts")
            }
            assert set(power) == {"0", "1"} and all(w > 0 for w in power.values())
            assert power[str(held["device_index"])] > min(power.values())  # busy draws more than idle
            assert _query(base, 'cpool_node_state{state="ready"} == 1')
            assert _query(base, "cpool_device_energy_joules > 0")
            # the member's token is refused: that target is down, saying why
            # (each target is scraped on its own schedule: wait for this one's first scrape)
            wait_for(
                "the member target's scrape", lambda: up("computepool-member") is not None, 30, log.read_text
            )
            assert up("computepool-member") == 0.0
            targets = httpx.get(f"{base}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            refused = next(t for t in targets if t["labels"]["job"] == "computepool-member")
            assert "403" in refused["lastError"]
            # the shipped rules load and evaluate against the pool's series
            groups = httpx.get(f"{base}/api/v1/rules", timeout=5).json()["data"]["groups"]
            assert {g["name"] for g in groups} == {"computepool-recording", "computepool-alerts"}
            ratio = wait_for("the recording rules", lambda: _query(base, "cpool:pool_allocated:ratio"), 15)
            assert float(ratio[0]["value"][1]) == pytest.approx(0.25)  # half of one of two devices
            rules = [r for g in groups for r in g["rules"]]
            wait_for(
                "every rule evaluated",
                lambda: all(
                    r.get("health") == "ok"
                    for g in httpx.get(f"{base}/api/v1/rules", timeout=5).json()["data"]["groups"]
                    for r in g["rules"]
                ),
                15,
            )
            assert len(rules) >= 10
            # every Grafana panel's query runs on this Prometheus (Grafana's variables filled in)
            for panel in json.loads(DASHBOARD.read_text())["panels"]:
                for target in panel["targets"]:
                    expr = target["expr"].replace("$node", ".*").replace("$__range", "5m")
                    r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=5)
                    assert r.status_code == 200, f"{panel['title']}: {expr}: {r.text}"
        finally:
            stop(prom, timeout=10)
