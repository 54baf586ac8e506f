"""The usage ledger end to end: a real `cpool server` booking every second, a real `cpool agent`
whose simulated A100s report power and an energy counter, a job run with `cpool run`, and what
`cpool usage` then says about it, its device's energy and the idle one's."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import JOB_PYTHON, Pool, child_env, cpool, free_port, stop, wait_for

SIM = "2xA100-80GB"  # reported as model A100; core.power: 55 W idle, 400 W at full use


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pool, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("usage")
    data, port = tmp / "server", free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []

    def output() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in logs if p.exists())

    def start(name: str, *args: str, env: dict[str, str] | None = None) -> None:
        log = tmp / f"{name}.log"
        logs.append(log)
        with log.open("wb") as out:
            procs.append(
                subprocess.Popen(cpool(*args), stdout=out, stderr=subprocess.STDOUT, env=env or child_env())
            )

    try:
        start(
            "server", "server", "--data-dir", str(data), "--port", str(port), "--ledger-interval", "1",
            "--heartbeat-s", "1", "--suspect-s", "3", "--lost-s", "6",
        )  # fmt: skip
        wait_for(
            "the server", lambda: (data / "admin-token").exists() and Pool(url, data).ready(), 30, output
        )
        api = Pool(url, data)
        token = api.http.post("/api/v1/join-tokens", json={}).json()["token"]
        start(
            "agent", "agent", "--server", url, "--data-dir", str(tmp / "agent"), "--simulate", SIM,
            "--name", "n1",
            env={**child_env(), "CPOOL_JOIN_TOKEN": token},
        )  # fmt: skip
        wait_for("the node", lambda: [n["state"] for n in api.nodes()] == ["ready"], 40, output)
        env = {**child_env(), "CPOOL_SERVER": url, "CPOOL_TOKEN": (data / "admin-token").read_text().strip()}
        yield api, env
        assert "Traceback" not in output(), output()
        api.close()
    finally:
        for p in reversed(procs):
            stop(p, signal.SIGTERM, timeout=30)


def ok(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cpool(*args), env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def usage(env: dict[str, str], *args: str) -> list[dict[str, Any]]:
    return list(json.loads(ok(env, "usage", *args, "--json").stdout))


def api_usage(api: Pool, by: str) -> list[dict[str, Any]]:
    r = api.http.get("/api/v1/usage", params={"by": by})
    assert r.status_code == 200, r.text
    return list(r.json()["items"])


def counters(api: Pool) -> float:
    """Σ of the devices' energy counters as /metrics exports them."""
    text = api.http.get("/metrics").text
    return sum(float(v) for v in re.findall(r"^cpool_device_energy_joules\{[^}]*\} (\S+)$", text, re.M))


def test_a_job_books_its_device_share_and_energy_and_idle_devices_go_to_the_pool(
    pool: tuple[Pool, dict[str, str]],
) -> None:
    api, env = pool
    ok(env, "run", "--gpus", "1", "--name", "burn", "--", JOB_PYTHON, "-c", "import time; time.sleep(4)")
    job = next(a for a in api.http.get("/api/v1/allocations").json()["items"] if a["name"] == "burn")
    assert job["state"] == "released", job
    held_s = (
        datetime.fromisoformat(job["ended_at"]) - datetime.fromisoformat(job["bound_at"])
    ).total_seconds()
    time.sleep(3)  # a few more ledger passes and heartbeats after the end
    row = next(r for r in usage(env, "--by", "job") if r["job"] == "burn")
    gpu_s = row["gpu_hours"] * 3600
    assert gpu_s == pytest.approx(held_s, abs=0.01)  # exactly bind → end (hours have six digits)
    watts = row["energy_kwh"] * 3.6e6 / gpu_s
    assert 55 <= watts <= 420, watts  # between the board's idle and peak draw
    assert row["cost"] == 0
    by_tenant = {r["tenant"]: r for r in api_usage(api, "tenant")}
    assert set(by_tenant) == {"default", "(pool)"}
    assert by_tenant["(pool)"]["energy_kwh"] > 0 and by_tenant["(pool)"]["gpu_hours"] == 0
    # every joule the counters counted since the node joined is booked once, give or take the
    # last heartbeat and pass (both 1 s; two boards at most 460 W together)
    booked = sum(r["energy_kwh"] for r in api_usage(api, "model")) * 3.6e6
    assert abs(counters(api) - booked) <= 3 * 460, (counters(api), booked)
    # prices turn GPU-hours and energy into cost; the CSV has the same figures
    model = api.nodes()[0]["devices"][0]["model"]
    ok(env, "prices", "set", model, "3.6")
    assert api.http.put("/api/v1/prices/energy-kwh", json={"amount": 0.2}).status_code == 200
    row = next(r for r in api_usage(api, "job") if r["job"] == "burn")
    # cost is priced from the unrounded figures; each of the three is shown to six digits
    rounding = 5e-7 * (3.6 + 0.2 + 1)
    assert row["cost"] == pytest.approx(row["gpu_hours"] * 3.6 + row["energy_kwh"] * 0.2, abs=rounding)
    lines = ok(env, "usage", "--by", "job", "--csv").stdout.splitlines()
    assert (
        lines[0]
        == "tenant,user,job,allocation_id,gpu_hours,cpu_hours,memory_gib_hours,energy_kwh,idle_waste_kwh,cost"
    )
    assert any(line.startswith(f"default,admin,burn,{job['id']},") for line in lines[1:]), lines
    # the pool used one device for one tenant: a static partition of one
    static = json.loads(ok(env, "usage", "--static-equivalent", "--json").stdout)
    assert (static["pool_devices"], static["static_devices"], static["devices_saved"]) == (1, 1, 0)
    assert static["pool_size_devices"] == 2
    # the device history: sampled once a minute (a 4 s job may fall between samples)
    history = api.http.get("/api/v1/nodes/n1/history", params={"since": "10m"}).json()["items"]
    assert {p["device_index"] for p in history} == {0, 1}
    # (a sample taken before the node's first heartbeat has no power yet)
    assert all(p["power_w"] is None or 55 <= p["power_w"] <= 420 for p in history), history


def test_another_tenants_member_sees_none_of_it(pool: tuple[Pool, dict[str, str]]) -> None:
    api, env = pool
    assert api.http.post("/api/v1/tenants", json={"name": "acme"}).status_code == 201
    api.http.post("/api/v1/users", json={"name": "ann", "tenant": "acme", "role": "member"})
    token = api.http.post("/api/v1/tokens", json={"user": "ann"}).json()["token"]
    member = {**env, "CPOOL_TOKEN": token}
    assert usage(member, "--by", "model") == []
    static = json.loads(ok(member, "usage", "--static-equivalent", "--json").stdout)
    assert static["tenants"] == [] and static["pool_devices"] == 0
