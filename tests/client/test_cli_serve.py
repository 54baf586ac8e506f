"""`cpool serve`, `cpool services` and `cpool tenants gateway-limit` against a real `cpool server`.

The spec a command sends is read back from the server (`cpool services --json`), so each check
covers the option parsing, the spec file, the HTTP client and the server's answer together.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from poolkit import Cli, PoolServer, one_error_line

from computepool.client import PoolClient

SRC = Path(__file__).resolve().parents[2] / "src/computepool"
SERVICES_API = SRC / "server/routers/services.py"
SIMENGINE = SRC / "serving/simengine.py"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
needs_services = pytest.mark.skipif(not SERVICES_API.exists(), reason="no services API in the server yet")


def _service(cli: Cli, name: str, *extra: str) -> dict:
    r = cli("services", "show", name, "--json", *extra)
    assert r.exit_code == 0, r.output
    return dict(json.loads(r.stdout))


# -- bad input: one line naming the field, before anything reaches the server -------------------


def test_spec_file_errors_name_the_file_and_line(cli: Cli, tmp_path: Path) -> None:
    cases = {
        "name: m\ncommand: [python3\nmin: 0\n": (":3", "not valid YAML"),
        "name: m\ncommand: python3 x\nreplicas: 3\n": (":3", "unknown key 'replicas'"),
        "name: m\ncommand: python3 x\n\ngpus: lots\n": (":4 gpus", "cannot read quantity 'lots'"),
        "name: m\ncommand: python3 x\nidle: soon\n": (":3 idle", "cannot read duration 'soon'"),
        "name: m\ncommand: python3 x\nenv:\n  1A: x\n": (":3 env", "'1A' is not a variable name"),
        "name: m\ncommand: python3 x\nmin: many\n": (":3 min", "expected a whole number"),
        "name: m\ncommand: python3 x\nno-code: 'no'\n": (":3 no_code", "expected true or false"),
        "- name: m\n": ("", "expected a mapping"),
        "name: m\ncommand: python3 x\nresources:\n  gpus: -1\n": (":4: resources.gpus", "must be ≥ 0"),
        "name: m\ncommand: python3 x\nresources:\n  cpu: 1\n": (":4: resources.cpu", "unknown key"),
        "name: m\ncommand: x\ncpus: 1\nresources: {cpus: 2}\n": (":4", "'cpus' given twice"),
    }
    for n, (text, (where, words)) in enumerate(cases.items()):
        spec = tmp_path / f"spec{n}.yaml"
        spec.write_text(text)
        line = one_error_line(cli("serve", "--file", str(spec), "--workdir", str(tmp_path)))
        assert f"{spec}{where}" in line and words in line, (text, line)
    line = one_error_line(cli("serve", "--file", str(tmp_path / "missing.yaml")))
    assert "--file" in line and "missing.yaml" in line


def test_command_line_errors_are_one_line(cli: Cli) -> None:
    for args, words in (
        (["m", "--gpus", "0.5"], "--command: a service needs the command"),
        (["m", "--command", 'a "b'], "--command: cannot split"),
        (["m", "--command", "a", "--", "b"], "give the command once"),
        (["m", "--command", "a", "--idle", "0"], "--idle: must be at least one second"),
        (["m", "--command", "a", "--gpus", "lots"], "--gpus"),
        (["m", "--command", "a", "--env", "NOVALUE"], "--env: expected KEY=VALUE"),
        (["m", "--delete", "--command", "a"], "--delete: takes only the service's name"),
        (["--command", "a"], "NAME: name the service"),
    ):
        line = one_error_line(cli("serve", *args, "--no-code"))
        assert words in line, (args, line)
    line = one_error_line(cli("services", "usage", "--by", "colour"))
    assert "--by" in line and "colour" in line


# -- against the server -------------------------------------------------------------------------


@needs_services
def test_serve_creates_updates_and_deletes(cli: Cli) -> None:
    args = ["chat", "--no-code", "--gpus", "0.25", "--min", "0", "--max", "4", "--target-inflight", "4"]
    args += ["--idle", "10m", "--drain", "0", "--command", "python3 engine.py --port-from-env 'A B'"]
    r = cli("serve", *args)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == (
        "service chat created (generation 1): min 0, max 4, target 4 in flight per replica"
    )
    spec = _service(cli, "chat")["spec"]
    assert spec["request"]["command"] == ["/bin/sh", "-c", "python3 engine.py --port-from-env 'A B'"]
    assert (spec["request"]["gpus"], spec["request"]["gpu_milli"]) == (1, 250)
    assert (spec["min_replicas"], spec["max_replicas"], spec["target_inflight"]) == (0, 4, 4)
    assert (spec["idle_s"], spec["drain_s"], spec["port_env"]) == (600, 0, "PORT")

    r = cli("serve", *args)
    assert r.exit_code == 0 and r.stdout.strip() == "service chat unchanged (generation 1)", r.output
    r = cli("serve", *args, "--max", "6", "--health-path", "/ready")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "service chat updated to generation 2: replicas are replaced one by one"
    got = _service(cli, "chat")
    assert (got["generation"], got["spec"]["max_replicas"], got["spec"]["health_path"]) == (2, 6, "/ready")

    listed = json.loads(cli("services", "--json").stdout)
    assert [s["name"] for s in listed] == ["chat"] and listed[0]["generation"] == 2
    table = cli("services").stdout
    row = next(line for line in table.splitlines() if line.lstrip().startswith("chat"))
    assert "default" in row and f"{got['ready']}/{got['desired']}" in row, table
    shown = cli("services", "show", "chat").stdout
    assert "service chat (tenant default, generation 2)" in shown, shown
    assert "/v1 with model chat" in shown

    r = cli("serve", "chat", "--delete")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("service chat deleted: ") and r.stdout.rstrip().endswith("replicas draining")
    line = one_error_line(cli("services", "show", "chat"))
    assert "chat" in line and "404" in line
    assert json.loads(cli("services", "--json").stdout) == []


@needs_services
def test_spec_file_with_flags_over_it_and_code_shipped(cli: Cli, tmp_path: Path) -> None:
    code = tmp_path / "engine"
    code.mkdir()
    (code / "engine.py").write_text("print('serving')\n")
    (tmp_path / "engine.env").write_text("# the engine's settings\nMODEL_DIR=/models\nTHREADS=2\n")
    spec = tmp_path / "serve.yaml"
    spec.write_text(
        "name: embed\n"
        "command: [python3, engine.py]\n"
        "port-env: ENGINE_PORT\n"
        "cpus: 1\n"
        "mem: 512MiB\n"
        "min: 1\n"
        "max: 2\n"
        "target_inflight: 8\n"
        "max_inflight: 9\n"
        "startup_grace: 2m\n"
        "scale_down_delay: 0\n"
        "queue_timeout: 30s\n"
        "workdir: engine\n"  # relative to the file
        "env_file: engine.env\n"
        "env:\n  THREADS: 4\n  MODE: fast\n"
    )
    r = cli("serve", "--file", str(spec), "--max", "3", "--env", "MODE=slow")
    assert r.exit_code == 0, r.output
    assert (
        r.stdout.strip()
        == "service embed created (generation 1): min 1, max 3, target 8 in flight per replica"
    )
    assert "code:" in r.stderr and "1 files" in r.stderr, r.stderr
    got = _service(cli, "embed")["spec"]
    req = got["request"]
    assert (
        req["command"] == ["python3", "engine.py"] and req["cpu_milli"] == 1000 and req["memory_mib"] == 512
    )
    assert req["env"] == {"MODEL_DIR": "/models", "THREADS": "4", "MODE": "slow"}
    assert isinstance(req["code"], str) and len(req["code"]) == 64
    assert (got["port_env"], got["max_inflight"], got["startup_grace_s"]) == ("ENGINE_PORT", 9, 120)
    assert (got["scale_down_delay_s"], got["queue_timeout_s"], got["max_replicas"]) == (0, 30, 3)
    cli("serve", "embed", "--delete")


def test_spec_file_resources_section_as_in_task_files(cli: Cli, tmp_path: Path) -> None:
    spec = tmp_path / "serve.yaml"
    spec.write_text("name: sized\ncommand: [python3, x.py]\nresources:\n  cpus: 0.5\n  mem: 256MiB\n")
    r = cli("serve", "--file", str(spec), "--no-code", "--mem", "384MiB")
    assert r.exit_code == 0, r.output
    req = _service(cli, "sized")["spec"]["request"]
    assert (req["cpu_milli"], req["memory_mib"]) == (500, 384)  # the flag over the file's section
    cli("serve", "sized", "--delete")


@needs_services
def test_server_refusals_and_other_tenants(cli: Cli, server: PoolServer) -> None:
    line = one_error_line(cli("serve", "bad", "--no-code", "--command", "x", "--port-env", "1PORT"))
    assert "port_env" in line, line
    line = one_error_line(cli("serve", "bad", "--no-code", "--command", "x", "--min", "3", "--max", "2"))
    assert "min_replicas 3 is above max_replicas 2" in line, line

    r = cli(
        "serve",
        "private",
        "--no-code",
        "--min",
        "0",
        "--json",
        "--",
        "python3",
        "-m",
        "http.server",
        "--bind",
        "::",
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["name"], out["generation"]) == ("private", 1)
    assert out["spec"]["request"]["command"] == ["python3", "-m", "http.server", "--bind", "::"]
    with PoolClient(server.url, token=server.token) as pool:
        pool.create_tenant("others")
        pool.create_user("olga", "others", "member")
        olga = pool.create_token(user="olga")["token"]
    as_olga = {"CPOOL_TOKEN": olga}
    for args in (["services", "show", "private"], ["serve", "private", "--delete"]):
        line = one_error_line(cli(*args, env=as_olga))
        assert "private" in line and "404" in line, (args, line)
    assert json.loads(cli("services", "--json", env=as_olga).stdout) == []
    r = cli("serve", "theirs", "--tenant", "others", "--no-code", "--min", "0", "--command", "x")
    assert r.exit_code == 0 and "service theirs created" in r.stdout, r.output
    assert [(s["name"], s["tenant"]) for s in json.loads(cli("services", "--json", env=as_olga).stdout)] == [
        ("theirs", "others")
    ]
    assert _service(cli, "theirs", "--tenant", "others")["owner"] == "admin"
    line = one_error_line(
        cli("serve", "mine", "--tenant", "default", "--no-code", "--command", "x", env=as_olga)
    )
    assert "tenant" in line, line
    assert _service(cli, "private", "--tenant", "default")["tenant"] == "default"  # the admin, by tenant
    assert cli("serve", "private", "--delete", "--tenant", "default").exit_code == 0


@needs_services
def test_tenants_gateway_limit_sets_shows_and_turns_off(cli: Cli) -> None:
    cli("tenants", "create", "limited")
    r = cli("tenants", "gateway-limit", "limited")
    assert r.exit_code == 0 and r.stdout.strip() == (
        "tenant limited: no gateway rate limit of its own (the gateway's --gateway-rpm applies)"
    ), r.output
    r = cli("tenants", "gateway-limit", "limited", "--rpm", "120")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "tenant limited: at most 120 gateway requests a minute, 20 at once"
    r = cli("tenants", "gateway-limit", "limited", "--rpm", "600", "--burst", "50")
    assert r.exit_code == 0, r.output
    got = json.loads(cli("tenants", "gateway-limit", "limited", "--json").stdout)
    assert got == {"tenant": "limited", "requests_per_minute": 600, "burst": 50}
    assert cli("tenants", "gateway-limit", "limited", "--off").exit_code == 0
    assert json.loads(cli("tenants", "gateway-limit", "limited", "--json").stdout) is None
    for args, words in (
        (["limited", "--off", "--rpm", "5"], "--off and --rpm"),
        (["limited", "--burst", "5"], "--burst needs --rpm"),
        (["nobody"], "nobody"),
        (["nobody", "--rpm", "5"], "nobody"),
    ):
        line = one_error_line(cli("tenants", "gateway-limit", *args))
        assert words in line, (args, line)


# -- a running replica: `cpool up` (server and agent), the simulated engine shipped as code ---------


@needs_services
def test_a_served_engine_answers_at_the_gateway_and_usage_is_summed(tmp_path: Path) -> None:
    from e2e_helpers import JOB_PYTHON, cpool, local_pool, wait_for

    code = tmp_path / "engine"
    code.mkdir()
    (code / "simengine.py").write_bytes(SIMENGINE.read_bytes())
    with local_pool(tmp_path) as (env, pool):

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(cpool(*args), env=env, capture_output=True, text=True, timeout=120)

        engine = f"{JOB_PYTHON} simengine.py --slots 2 --ms-per-token 1"
        r = run("serve", "echo", "--command", engine, "--workdir", str(code), "--cpus", "0.5",
                "--min", "1", "--max", "1", "--startup-grace", "2m")  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        assert "service echo created (generation 1): min 1, max 1" in r.stdout

        def ready() -> dict | None:
            out = json.loads(run("services", "show", "echo", "--json").stdout)
            return out if out["ready"] == 1 else None

        shown = wait_for("a ready replica", ready, 120, lambda: run("services", "show", "echo").stdout)
        replica = shown["replicas"][0]
        assert replica["replica_state"] == "ready" and replica["endpoint"].startswith("http://")
        table = run("services", "show", "echo").stdout
        row = next(ln for ln in table.splitlines() if ln.lstrip().startswith(str(replica["allocation_id"])))
        assert "active" in row and "ready" in row and replica["endpoint"] in row, table

        body = {"model": "echo", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}
        answers = [pool.http.post("/v1/chat/completions", json=body) for _ in range(3)]
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        prompt = sum(a.json()["usage"]["prompt_tokens"] for a in answers)
        completion = sum(a.json()["usage"]["completion_tokens"] for a in answers)

        def summed() -> list | None:
            rows = json.loads(run("services", "usage", "--since", "1h", "--json").stdout)
            return rows if rows and rows[0]["requests"] == 3 else None

        rows = wait_for("the usage flushed", summed, 30)
        assert rows == [{"tenant": "default", "service": "echo", "requests": 3, "failed": 0,
                         "prompt_tokens": prompt, "completion_tokens": completion}]  # fmt: skip
        by_tenant = json.loads(run("services", "usage", "--by", "tenant", "--json").stdout)
        assert [(u["tenant"], u["requests"]) for u in by_tenant] == [("default", 3)]
        table = run("services", "usage", "--by", "user").stdout
        assert re.search(rf"admin\s*│\s*3\s*│\s*0\s*│\s*{prompt}\s*│\s*{completion}", table), table

        r = run("serve", "echo", "--delete")
        assert r.returncode == 0 and r.stdout.strip() == "service echo deleted: 1 replica draining", r.stdout
        wait_for(
            "the replica released",
            lambda: pool.state(replica["allocation_id"]) in ("released", "cancelled"),
            90,
        )
