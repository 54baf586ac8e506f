"""The Prometheus files shipped in deploy/prometheus load in Prometheus's own checker, and the
alerting rules behave as their unit tests say (`promtool test rules`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
RULES = DEPLOY / "computepool-rules.yml"


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing: `apt-get install prometheus` (CI installs it)", pytrace=False)
        pytest.skip("promtool is not installed")
    return found


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_rules_pass_promtool_check(promtool: str) -> None:
    r = run(promtool, "check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_rules_unit_tests_pass(promtool: str) -> None:
    r = run(promtool, "test", "rules", str(DEPLOY / "computepool-rules.test.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_broken_rule_is_caught(promtool: str, tmp_path: Path) -> None:
    """The check is not vacuous: a rule file with a bad expression fails it."""
    bad = tmp_path / "bad.yml"
    bad.write_text(RULES.read_text().replace("cpool_device_healthy == 0", "cpool_device_healthy == ", 1))
    r = run(promtool, "check", "rules", str(bad))
    assert r.returncode != 0 and "parse error" in (r.stdout + r.stderr)


def test_example_scrape_config_is_valid(promtool: str, tmp_path: Path) -> None:
    """deploy/prometheus/prometheus.yml, its /etc/prometheus files put in a temporary folder."""
    shutil.copy(RULES, tmp_path / "computepool-rules.yml")
    (tmp_path / "computepool-token").write_text("cp_example.secret\n")
    (tmp_path / "computepool-ca.pem").write_text("")
    config = (DEPLOY / "prometheus.yml").read_text().replace("/etc/prometheus", str(tmp_path))
    (tmp_path / "prometheus.yml").write_text(config)
    r = run(promtool, "check", "config", str(tmp_path / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 rule files found" in r.stdout
