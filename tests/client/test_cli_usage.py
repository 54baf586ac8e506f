"""`cpool usage` and `cpool prices` against a real `cpool server`: JSON as the API's items, CSV with
a header row, tables with their footnote, cost from prices set through the CLI, tenant scoping,
and bad input as one line. Ledger rows of a known past hour are written into the server's own
database, as its Accountant would book them, so the figures are exact."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from poolkit import Cli, PoolServer, one_error_line, start_server
from sqlalchemy import select
from sqlalchemy.orm import Session

from computepool.client import PoolClient
from computepool.store import usage as sql
from computepool.store.db import Database
from computepool.store.models import Allocation, AllocationEvent, Device, Node, Tenant

HOUR = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolServer]:
    """A pool whose own Accountant books nothing while the module runs: the figures are the rows
    written below alone (on a busy machine its pass every 10 s booked the seeded history too)."""
    with start_server(tmp_path_factory.mktemp("usagepool"), "--ledger-interval", "3600") as s:
        yield s


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
        seed_history(s)
    db.dispose()
    return server


def seed_history(s: Session) -> None:
    """Nodes n1 (3 A100s) and n2 (a T4), and three allocations that held them three hours ago:
    blue 2 whole A100s for 0–30 min; red then 1 A100 for 30–60 min (on a device blue had freed)
    and half the T4 for 0–60 min. Written as the server writes them (rows and state changes)."""
    tenants = {t.name: t.id for t in s.scalars(select(Tenant))}
    n1 = Node(name="n1", cpu_milli=16000, memory_mib=65536, labels={}, joined_at=HOUR, last_heartbeat_at=HOUR)
    n2 = Node(name="n2", cpu_milli=16000, memory_mib=65536, labels={}, joined_at=HOUR, last_heartbeat_at=HOUR)
    s.add_all([n1, n2])
    s.flush()
    for node, index, model in ((n1, 0, "A100"), (n1, 1, "A100"), (n1, 2, "A100"), (n2, 0, "T4")):
        s.add(
            Device(
                node_id=node.id, index=index, vendor="nvidia", model=model, memory_mib=40960,
                uuid=f"GPU-{node.name}-{index}", compute_milli=1000, link_group="",
            )
        )  # fmt: skip
    held = [
        ("blue", "bo", "wide", [("n1", 0, 1000), ("n1", 1, 1000)], 0, 30),
        ("red", "ru", "late", [("n1", 0, 1000)], 30, 60),
        ("red", "ru", "half", [("n2", 0, 500)], 0, 60),
    ]
    for tenant, owner, name, slices, start, end in held:
        bound, ended = HOUR + timedelta(minutes=start), HOUR + timedelta(minutes=end)
        a = Allocation(
            name=name, tenant_id=tenants[tenant], owner=owner, request={"gpus": len(slices)}, priority=0,
            restartable=False, state="released", reason="released", attempt=1, term=1,
            nodes=sorted({n for n, _, _ in slices}),
            slices=[{"node": n, "device_index": i, "compute_milli": m} for n, i, m in slices],
            created_at=bound, bound_at=bound, ended_at=ended,
        )  # fmt: skip
        s.add(a)
        s.flush()
        for at, state in ((bound, "pending"), (bound, "bound"), (ended, "released")):
            s.add(AllocationEvent(allocation_id=a.id, at=at, state=state, reason=state, attempt=1, term=1))


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
    typo = cli("prices", "set", "A100-80GB", "2.5")  # stored, with a warning naming the right one
    assert typo.exit_code == 0 and "did you mean A100?" in typo.stderr and "warning" not in typo.stdout
    cli("prices", "delete", "A100-80GB")
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
    """A100: the pool had at most 2 in use at once (blue's two, then red's one); static partitions
    need blue 2 + red 1 = 3. T4: 1 and 1. So 3 against 4 of the pool's 4 devices: 1 saved (25%),
    worth 1 A100 × the window's hours at 3 per GPU-hour and its idle 55 W at 0.25 per kWh. Energy
    booked in the window: A100 0.5 + 0.06 (the pool's idle one), T4 0.02 kWh."""
    for item, amount in (("A100", "3"), ("energy-kwh", "0.25")):
        assert cli("prices", "set", item, amount).exit_code == 0
    cli("prices", "delete", "T4")
    r = cli("usage", "--static-equivalent", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    hours = (
        datetime.fromisoformat(out["until"]) - datetime.fromisoformat(out["since"])
    ).total_seconds() / 3600
    # 30 days asked; the pool's history begins with the seeded nodes and allocations (HOUR)
    assert out["clipped"] is True and datetime.fromisoformat(out["since"]) == HOUR
    assert 3 <= hours <= 5  # HOUR is a whole hour, 3 to 4 hours before the module was imported
    figures = ("pool_devices", "static_devices", "devices_saved", "pool_size_devices")
    assert [out[f] for f in figures] == [3, 4, 1, 4]
    assert out["devices_saved_pct"] == 25.0
    assert out["models"] == {
        "A100": {"pool_devices": 2, "static_devices": 3, "pool_size_devices": 3},
        "T4": {"pool_devices": 1, "static_devices": 1, "pool_size_devices": 1},
    }
    parts = {(p["tenant"], p["model"]): (p["static_devices"], p["peak_gpus"]) for p in out["tenants"]}
    assert parts == {("blue", "A100"): (2, 2.0), ("red", "A100"): (1, 1.0), ("red", "T4"): (1, 0.5)}
    assert out["energy_pool_kwh"] == pytest.approx(0.58, abs=1e-6) and out["energy_pool_includes_empty"]
    # figures are given to 6 decimals: compare to that
    assert out["energy_saved_kwh"] == pytest.approx(55 * hours / 1000, abs=2e-6)
    assert out["cost_pool"] == pytest.approx(2 * hours * 3 + 0.58 * 0.25, abs=2e-6)
    assert out["cost_saved"] == pytest.approx(hours * 3 + 55 * hours / 1000 * 0.25, abs=2e-6)
    r = cli("usage", "--static-equivalent")
    assert r.exit_code == 0, r.output
    assert (
        "at most 3 devices held work at once (the pool has 4); static per-tenant partitions would "
        "have needed 4" in " ".join(r.stdout.split())
    ), r.stdout
    assert "saved: 1 device (25%)" in r.stdout and "method:" in r.stdout
    # red's own view: its own peak (1 A100, 1 T4) against its partitions; energy its share only
    with PoolClient(seeded.url, token=seeded.token) as pool:
        token = pool.create_token(user="ru")["token"]
    mine = json.loads(cli("usage", "--static-equivalent", "--json", env={"CPOOL_TOKEN": token}).stdout)
    assert (mine["pool_devices"], mine["static_devices"], mine["devices_saved"]) == (2, 2, 0)
    assert mine["energy_pool_kwh"] == pytest.approx(0.02, abs=1e-6) and not mine["energy_pool_includes_empty"]
    r = cli("usage", "--static-equivalent", env={"CPOOL_TOKEN": token})
    assert "your tenant's share only" in r.stdout, r.stdout


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


def test_a_truncated_job_list_says_so_on_stderr(cli: Cli, seeded: PoolServer) -> None:
    """More jobs than one answer holds (host-share rows ten days back, outside the other tests'
    windows): --json stays a list; stderr says the list is cut."""
    old = HOUR - timedelta(days=10)
    db = Database(f"sqlite:///{seeded.data_dir / 'pool.db'}")
    with db.write() as s:
        sql.book(
            s,
            [sql.Entry(old, 1000 + i, "blue", "bo", "j", "", "n1", "", 0, 1, 0, 0, 0) for i in range(10_001)],
        )
    db.dispose()
    r = cli(
        "usage",
        "--by",
        "job",
        "--since",
        (old - timedelta(hours=1)).isoformat(),
        "--until",
        (old + timedelta(hours=1)).isoformat(),
        "--json",
    )
    assert r.exit_code == 0, r.stderr
    assert len(json.loads(r.stdout)) == 10_000
    assert "only the newest 10000 jobs are listed" in r.stderr
