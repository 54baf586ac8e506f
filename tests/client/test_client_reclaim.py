"""`cpool tenants reclaim` and the time left in `cpool ps`, against a real `cpool server`."""

from __future__ import annotations

import json
import re

from poolkit import Cli, PoolServer

from computepool.client import PoolClient


def test_tenants_reclaim_shows_sets_and_turns_off(cli: Cli) -> None:
    cli("tenants", "create", "idlers")
    r = cli("tenants", "reclaim", "idlers")
    assert r.exit_code == 0 and r.stdout.strip() == "tenant idlers: idle reclaim off", r.output
    r = cli("tenants", "reclaim", "idlers", "--idle", "30m", "--warn", "10m")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "tenant idlers: allocations idle for 30m are released, warned 10m before"
    got = json.loads(cli("tenants", "reclaim", "idlers", "--json").stdout)
    assert (got["enabled"], got["idle_s"], got["warn_s"]) == (True, 1800, 600)
    r = cli("tenants", "reclaim", "idlers", "--off")
    assert r.exit_code == 0 and "off" in r.stdout
    assert json.loads(cli("tenants", "reclaim", "idlers", "--json").stdout)["enabled"] is False


def test_tenants_reclaim_bad_input_is_one_line(cli: Cli) -> None:
    cli("tenants", "create", "idlers2")
    for args, words in (
        (["--idle", "10m", "--warn", "1h"], "warn"),
        (["--idle", "soon"], "idle"),
        (["--warn", "5m"], "--warn needs --idle"),
        (["--idle", "1h", "--off"], "--off and --idle"),
    ):
        r = cli("tenants", "reclaim", "idlers2", *args)
        assert r.exit_code != 0, (args, r.output)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in r.output, (args, r.output)
    r = cli("tenants", "reclaim", "nobody", "--idle", "1h")
    assert r.exit_code == 1 and "not found" in r.stderr


def test_ps_shows_the_time_left(cli: Cli, server: PoolServer) -> None:
    with PoolClient(server.url, token=server.token) as pool:
        token = pool.create_join_token()["token"]
        device = {"index": 0, "vendor": "nvidia", "model": "A100", "memory_mib": 40960, "uuid": "GPU-tl-0"}
        pool.join_node(token, "tl-node", cpu_milli=8000, memory_mib=32768, devices=[device])
    r = cli("alloc", "--gpus", "1", "--time-limit", "2h", "--json")
    assert r.exit_code == 0, r.output
    alloc_id = json.loads(r.stdout)["id"]
    table = cli("ps").stdout
    row = next(line for line in table.splitlines() if line.strip().startswith(str(alloc_id)))
    assert re.search(r"bound \((1h59m\d+s|2h) left\)", row), table  # two hours from the bind
    assert re.search(r"time limit 2h: (1h59m\d+s|2h) left", cli("explain", str(alloc_id)).stdout)
    cli("release", str(alloc_id))
