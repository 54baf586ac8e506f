"""The Grafana dashboard and the Prometheus rules in deploy/ name only metrics the pool exports
(or that the rules record), so neither goes blank when a family is renamed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import Api
from prometheus_client.parser import text_string_to_metric_families

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "computepool-dashboard.json"
RULES = DEPLOY / "prometheus" / "computepool-rules.yml"
NAME = re.compile(r"\bcpool(?::[a-z0-9_]+:[a-z0-9_]+|_[a-z0-9_]+)\b")


@pytest.fixture
def backend() -> str:
    return "sqlite"  # the families do not depend on the database


@pytest.fixture
def exported(api: Api) -> set[str]:
    """Every family name /metrics declares (HELP/TYPE lines come even for a family with no sample)."""
    text = api.get("/metrics", headers=api.admin).text
    names = {f.name for f in text_string_to_metric_families(text)}
    # a histogram's family is declared once; its series carry these suffixes
    names |= {f"{n}{s}" for n in names for s in ("_bucket", "_count", "_sum")}
    return names


def rule_list() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def recorded() -> set[str]:
    return {r["record"] for r in rule_list() if "record" in r}


def test_contracted_families_are_exported(exported: set[str]) -> None:
    for name in (
        "cpool_device_utilization_percent",
        "cpool_device_memory_used_mib",
        "cpool_device_power_watts",
        "cpool_device_energy_joules",
        "cpool_device_healthy",
        "cpool_node_state",
        "cpool_node_heartbeat_age_seconds",
        "cpool_alerts_firing",
        "cpool_alert_firing",
        "cpool_audit_chain_intact",
    ):
        assert name in exported, name


def test_every_dashboard_panel_queries_exported_metrics(exported: set[str]) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels) >= 10
    known = exported | recorded()
    for p in panels:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            names = set(NAME.findall(t["expr"]))
            assert names, f"panel {p['title']!r}: {t['expr']!r} names no cpool_ metric"
            assert names <= known, f"panel {p['title']!r} names unknown {sorted(names - known)}"
    for var in dash["templating"]["list"]:
        assert set(NAME.findall(var["definition"])) <= known, var["name"]


def test_every_rule_queries_exported_metrics(exported: set[str]) -> None:
    known = exported | recorded()
    rules = rule_list()
    assert {r["alert"] for r in rules if "alert" in r} >= {
        "ComputePoolScrapeDown",
        "ComputePoolNodeLost",
        "ComputePoolNodeSuspect",
        "ComputePoolDeviceUnhealthy",
        "ComputePoolDevicesAllocatedIdle",
        "ComputePoolPendingWithFreeCapacity",
        "ComputePoolAuditChainBroken",
    }
    for r in rules:
        names = set(NAME.findall(r["expr"]))
        assert names or "up{" in r["expr"], r
        assert names <= known, f"{r.get('alert') or r.get('record')} names unknown {sorted(names - known)}"
