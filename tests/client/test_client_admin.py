"""The admin commands against a real server: login, tenants, users, tokens, quotas, nodes, audit."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from poolkit import Cli, PoolServer

from computepool.client import PoolClient


def test_login_writes_a_private_config_used_by_later_commands(
    cli: Cli, server: PoolServer, tmp_path: Path
) -> None:
    token_file = server.data_dir / "admin-token"
    r = cli("login", "--server", server.url, "--token-file", str(token_file), env={"CPOOL_TOKEN": None})
    assert r.exit_code == 0, r.output
    config = tmp_path / "config.json"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert json.loads(config.read_text()) == {"server": server.url, "token": server.token}
    assert "admin" in r.stdout and server.token not in r.stdout
    # no flags, no environment: the saved config is enough
    r = cli("tenants", "list", "--json", env={"CPOOL_SERVER": None, "CPOOL_TOKEN": None})
    assert r.exit_code == 0, r.output
    assert "default" in [t["name"] for t in json.loads(r.stdout)]
    # a flag beats the environment, which beats the file
    r = cli("tenants", "list", "--token", "0123456789abcdef.wrong", env={"CPOOL_SERVER": None})
    assert r.exit_code == 1 and "token" in r.stderr and "HTTP 401" in r.stderr


def test_tenants_users_tokens_round_trip(cli: Cli, server: PoolServer) -> None:
    assert cli("tenants", "create", "acme", "--weight", "3").exit_code == 0
    tenants = json.loads(cli("tenants", "list", "--json").stdout)
    assert [t["weight"] for t in tenants if t["name"] == "acme"] == [3.0]
    r = cli("users", "create", "bob", "--tenant", "acme", "--role", "member", "--json")
    assert json.loads(r.stdout)["tenant"] == "acme"
    users = json.loads(cli("users", "list", "--json").stdout)
    assert ("bob", "acme", "member") in [(u["name"], u["tenant"], u["role"]) for u in users]

    r = cli("tokens", "create", "--user", "bob", "--expires", "30d")
    assert r.exit_code == 0, r.output
    bob = r.stdout.strip()  # only the token on stdout, so T=$(cpool tokens create) works
    assert bob.count(".") == 1 and "shown only now" in r.stderr
    me = json.loads(cli("tokens", "list", "--json", env={"CPOOL_TOKEN": bob}).stdout)
    assert [t["user"] for t in me] == ["bob"] and me[0]["expires_at"]
    assert "bob" in cli("tokens", "list").stdout

    r = cli("tokens", "revoke", bob.split(".")[0])
    assert r.exit_code == 0 and "revoked" in r.stdout
    assert "revoked" in cli("tenants", "list", env={"CPOOL_TOKEN": bob}).stderr


def test_quota_set_get_in_human_units(cli: Cli) -> None:
    cli("tenants", "create", "q1")
    r = cli("quota", "set", "q1", "--gpus", "0.5", "--gpus-limit", "2", "--gpu-mem", "10GiB", "--json")
    assert r.exit_code == 0, r.output
    r = cli("quota", "set", "q1", "--cpus", "500m", "--mem", "4GiB", "--mem-limit", "8GiB", "--json")
    q = json.loads(r.stdout)
    assert q["gpu_milli"] == {"guaranteed": 500, "limit": 2000}  # kept: set merges
    assert q["gpu_memory_mib"] == {"guaranteed": 10240, "limit": 10240}
    assert q["cpu_milli"] == {"guaranteed": 500, "limit": 500}
    assert q["memory_mib"] == {"guaranteed": 4096, "limit": 8192}
    assert json.loads(cli("quota", "get", "q1", "--json").stdout) == q
    table = cli("quota", "get", "q1").stdout
    assert "0.5" in table and "10GiB" in table and "8GiB" in table
    q = json.loads(cli("quota", "set", "q1", "--gpus", "3", "--replace", "--json").stdout)
    assert q["gpu_milli"] == {"guaranteed": 3000, "limit": 3000} and "cpu_milli" not in q


def test_join_token_nodes_and_cordon(cli: Cli, server: PoolServer) -> None:
    r = cli("join-token", "--expires", "1h", "--reusable", "--json")
    jt = json.loads(r.stdout)
    assert jt["single_use"] is False
    token = cli("join-token").stdout.strip()
    with PoolClient(server.url) as anon:
        for name, tok in (("n1", jt["token"]), ("n2", token)):
            devices = [
                {
                    "index": i,
                    "vendor": "nvidia",
                    "model": "A100",
                    "memory_mib": 40960,
                    "uuid": f"GPU-{name}-{i}",
                }
                for i in range(2)
            ]
            anon.join_node(tok, name, cpu_milli=16000, memory_mib=65536, devices=devices)
    nodes = json.loads(cli("nodes", "--json").stdout)
    assert {"n1", "n2"} <= {n["name"] for n in nodes}
    assert [n["name"] for n in json.loads(cli("nodes", "list", "--json").stdout)] == [
        n["name"] for n in nodes
    ]
    listing = cli("nodes").stdout
    assert "n1" in listing and "A100" in listing and "40GiB" in listing

    assert json.loads(cli("nodes", "cordon", "n1", "--json").stdout)["cordoned"] is True
    assert "draining" in cli("nodes", "drain", "n1").stdout
    assert "cordoned" in cli("nodes").stdout or "draining" in cli("nodes").stdout
    out = json.loads(cli("nodes", "uncordon", "n1", "--json").stdout)
    assert (out["cordoned"], out["draining"]) == (False, False)


def test_audit_list_and_verify(cli: Cli) -> None:
    cli("tenants", "create", "audited")
    records = json.loads(cli("audit", "list", "--json").stdout)
    assert any(r["action"] == "tenant.create" and r["target"].endswith("audited") for r in records)
    only = json.loads(cli("audit", "list", "--action", "tenant.create", "--since", "1h", "--json").stdout)
    assert only and {r["action"] for r in only} == {"tenant.create"}
    assert json.loads(cli("audit", "list", "--until", "2000-01-01T00:00:00", "--json").stdout) == []
    assert "tenant.create" in cli("audit", "list", "--actor", "user:admin").stdout
    r = cli("audit", "verify")
    assert r.exit_code == 0 and "intact" in r.stdout
    assert json.loads(cli("audit", "verify", "--json").stdout)["ok"] is True


def test_tenant_ceilings_in_human_units_and_their_refusal(cli: Cli) -> None:
    cli("tenants", "create", "c1")
    r = cli("tenants", "defaults", "c1", "--max-time-limit", "2h", "--max-array", "8")
    assert r.exit_code == 0, r.output
    assert "gets 2h" in r.stdout and "the longest it may ask for: 2h" in r.stdout and "array: 8" in r.stdout
    r = cli("tenants", "defaults", "c1", "--time-limit", "3h")  # over the ceiling: refused, named
    assert r.exit_code == 1 and "time_limit_s" in r.stderr and "over the longest" in r.stderr, r.output
    assert "--max-array" in cli("tenants", "defaults", "c1", "--max-array", "lots").stderr
    out = json.loads(cli("tenants", "defaults", "c1", "--max-array", "none", "--json").stdout)
    assert (out["max_time_limit_s"], out["max_array"]) == (7200, None)
    r = cli("run", "--tenant", "c1", "--time-limit", "1d", "--detach", "--no-code", "--", "true")
    assert r.exit_code == 1 and "over tenant c1's longest, 2h" in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1
