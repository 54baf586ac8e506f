"""`cpool usage` and `cpool prices` against a real `cpool server`: JSON as the API's items, CSV with
a header row, tables with their footnote, cost from prices set through the CLI, tenant scoping,
and bad input as one line. Ledger rows of a known past hour are written into the server's own
database, as its Accountant would book them, so the figures are exact."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta

import pytest
from poolkit import Cli, PoolServer, one_error_line

from computepool.client import PoolClient
from computepool.store import usage as sql
from computepool.store.db import Database

HOUR = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)


@pytest.fixture(scope="module")
def seeded(server: PoolServer) -> PoolServer:
    """Team 'blue': bo's job 'train' held 2 A100s for an hour at 250 W (0.5 kWh); its host share
    4 CPUs, 8 GiB. Team 'red': ru's 'probe' held half a T4 for an hour, idle at 20 W. The pool's
    own: a free A100 idling at 60 W."""
    with PoolClient(server.url, token=server.token) as pool:
        for team in ("blue", "red"):
            pool.create_tenant(team)
        pool.create_user("ru", "red", "member")
    db = Database(f"sqlite:///{server.data_dir / 'pool.db'}")
    with db.write() as s:
        sql.book(
            s,
            [
                sql.Entry(HOUR, 101, "blue", "bo", "train", "", "n1", "A100", 7200, 0, 0, 2 * 250 * 3600, 0),
                sql.Entry(HOUR, 101, "blue", "bo", "train", "", "n1", "", 0, 4 * 3600, 8192 * 3600, 0, 0),
                sql.Entry(HOUR, 102, "red", "ru", "probe", "", "n2", "T4", 1800, 0, 0, 20 * 3600, 20 * 3600),
                sql.Entry(HOUR, 0, "", "", "", "", "n1", "A100", 0, 0, 0, 60 * 3600, 0),
            ],
        )
    db.dispose()
    return server


def usage_json(cli: Cli, *args: str, env: dict[str, str | None] | None = None) -> list[dict[str, object]]:
    r = cli("usage", *args, "--json", env=env)
    assert r.exit_code == 0, r.output
    return list(json.loads(r.stdout))


def test_json_is_the_apis_items_and_csv_has_a_header(cli: Cli, seeded: PoolServer) -> None:
    rows = usage_json(cli, "--by", "tenant")
    with PoolClient(seeded.url, token=seeded.token) as pool:
        assert rows == pool.usage("tenant", "7d")
    got = {r["tenant"]: r for r in rows}
    assert set(got) == {"blue", "red", "(pool)"}
    blue = got["blue"]
    assert (blue["gpu_hours"], blue["cpu_hours"], blue["memory_gib_hours"]) == (2.0, 4.0, 8.0)
    assert (blue["energy_kwh"], blue["idle_waste_kwh"]) == (0.5, 0.0)
    assert (got["red"]["gpu_hours"], got["red"]["idle_waste_kwh"]) == (0.5, 0.02)
    assert got["(pool)"]["energy_kwh"] == 0.06
    jobs = usage_json(cli, "--by", "job", "--since", (HOUR - timedelta(hours=1)).isoformat())
    assert {(r["job"], r["allocation_id"]) for r in jobs} == {("train", 101), ("probe", 102), ("", 0)}
    r = cli("usage", "--by", "model", "--csv")
    assert r.exit_code == 0, r.output
    table = list(csv.DictReader(io.StringIO(r.stdout)))
    assert (
        r.stdout.splitlines()[0]
        == "model,gpu_hours,cpu_hours,memory_gib_hours,energy_kwh,idle_waste_kwh,cost"
    )
    assert {row["model"]: float(row["gpu_hours"]) for row in table} == {"": 0.0, "A100": 2.0, "T4": 0.5}


def test_cost_follows_prices_set_with_the_cli(cli: Cli, seeded: PoolServer) -> None:
    r = cli("usage")
    assert r.exit_code == 0 and "no price for A100, T4, energy-kwh" in r.stdout, r.output
    for item, amount in (("A100", "3"), ("T4", "1.2"), ("energy-kwh", "0.25")):
        r = cli("prices", "set", item, amount)
        assert r.exit_code == 0 and r.stdout.strip() == f"price of {item}: {float(amount):g}", r.output
    got = {r["tenant"]: r["cost"] for r in usage_json(cli)}
    assert got == pytest.approx(
        {"blue": 2 * 3 + 0.5 * 0.25, "red": 0.5 * 1.2 + 0.02 * 0.25, "(pool)": 0.06 * 0.25}
    )
    r = cli("usage")
    assert "no price" not in r.stdout and "blue" in r.stdout and "6.1" in r.stdout, r.stdout
    listed = json.loads(cli("prices", "--json").stdout)
    assert [(p["item"], p["amount"]) for p in listed] == [("A100", 3.0), ("T4", 1.2), ("energy-kwh", 0.25)]
    assert "GPU-hour" in cli("prices").stdout
    r = cli("prices", "delete", "T4")
    assert r.exit_code == 0 and r.stdout.strip() == "price of T4 removed"
    assert {r["tenant"]: r["cost"] for r in usage_json(cli)}["red"] == pytest.approx(0.02 * 0.25)


def test_a_member_sees_its_tenants_rows_only(cli: Cli, seeded: PoolServer) -> None:
    with PoolClient(seeded.url, token=seeded.token) as pool:
        token = pool.create_token(user="ru")["token"]
    rows = usage_json(cli, "--by", "user", env={"CPOOL_TOKEN": token})
    assert [(r["tenant"], r["user"]) for r in rows] == [("red", "ru")]
    assert usage_json(cli, "--by", "model", env={"CPOOL_TOKEN": token})[0]["model"] == "T4"
    line = one_error_line(cli("prices", "set", "A100", "1", env={"CPOOL_TOKEN": token}))
    assert "may not price.set" in line


def test_static_equivalent_prints_json_and_a_table(cli: Cli, seeded: PoolServer) -> None:
    r = cli("usage", "--static-equivalent", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert {"pool_devices", "static_devices", "devices_saved", "cost_saved", "energy_saved_kwh"} <= set(out)
    r = cli("usage", "--static-equivalent", "--since", "7d")
    assert r.exit_code == 0 and "static per-tenant partitions would have needed" in r.stdout, r.output
    assert "method:" in r.stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--by", "team"], "--by"),
        (["--json", "--csv"], "not both"),
        (["--since", "soon"], "since"),
        (["--static-equivalent", "--csv"], "--static-equivalent"),
    ],
)
def test_bad_input_is_one_line(cli: Cli, args: list[str], words: str) -> None:
    assert words in one_error_line(cli("usage", *args))


def test_bad_prices_are_one_line(cli: Cli) -> None:
    assert "AMOUNT" in one_error_line(cli("prices", "set", "A100", "cheap"))
    assert "amount" in one_error_line(cli("prices", "set", "A100", "--", "-1"))
    assert "not found" in one_error_line(cli("prices", "delete", "nothing"))
