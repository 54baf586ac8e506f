"""Static capacity end to end: a labelled agent, selectors, taints and dedication through the CLI.

A real `cpool server` and two real `cpool agent` processes on loopback; every change is made
with the `cpool` commands an admin types, and checked through the API and `cpool explain`.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import JOB_PYTHON, Pool, child_env, cpool, free_port, stop, wait_for

from computepool.agent.join import tenant_pythons


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pool, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("dedicate")
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
        start("server", "server", "--data-dir", str(data), "--port", str(port))
        wait_for(
            "the server", lambda: (data / "admin-token").exists() and Pool(url, data).ready(), 30, output
        )
        api = Pool(url, data)
        for name, sim, labels in (("big", "1xA100-80GB", ["gpu-class=a100"]), ("small", "1xT4-16GB", [])):
            token = api.http.post("/api/v1/join-tokens", json={}).json()["token"]
            extra = [a for lab in labels for a in ("--label", lab)]
            start(
                name,
                "agent", "--server", url, "--data-dir", str(tmp / name), "--simulate", sim, "--name", name,
                *extra,
                env={**child_env(), "CPOOL_JOIN_TOKEN": token},
            )  # fmt: skip
        wait_for(
            "both nodes ready",
            lambda: sorted(n["name"] for n in api.nodes() if n["state"] == "ready") == ["big", "small"],
            40,
            output,
        )
        env = {**child_env(), "CPOOL_SERVER": url, "CPOOL_TOKEN": (data / "admin-token").read_text().strip()}
        yield api, env
        api.close()
    finally:
        for p in reversed(procs):
            stop(p, signal.SIGTERM, timeout=30)


def run(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cpool(*args), env=env, capture_output=True, text=True, timeout=timeout)


def ok_json(env: dict[str, str], *args: str) -> Any:
    r = run(env, *args, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_agent_label_selects_the_node_for_a_job(pool: tuple[Pool, dict[str, str]]) -> None:
    api, env = pool
    assert {n["name"]: n["labels"].get("gpu-class") for n in api.nodes()} == {"big": "a100", "small": None}
    code = "import os; print('ran with', os.environ['CUDA_VISIBLE_DEVICES'][:4])"
    r = run(env, "run", "--gpus", "0.5", "--node-selector", "gpu-class=a100", "--", JOB_PYTHON, "-c", code)
    assert r.returncode == 0 and "ran with GPU-" in r.stdout, r.stdout + r.stderr
    done = [
        a for a in api.http.get("/api/v1/allocations").json()["items"] if a["request"].get("node_selector")
    ]
    assert done and all(a["nodes"] == ["big"] for a in done), done


def test_cli_labels_taints_and_dedication_steer_and_explain(pool: tuple[Pool, dict[str, str]]) -> None:
    api, env = pool
    pythons = {f"cpool.io/python-{v}": "yes" for v in tenant_pythons()}  # the agent reports these
    pythons["cpool.io/node"] = "small"  # every node carries its own name
    out = ok_json(env, "nodes", "label", "small", "gpu-class=t4", "zone=b")
    assert out["labels"] == {"gpu-class": "t4", "simulated": "true", "zone": "b", **pythons}  # agent's kept
    assert ok_json(env, "nodes", "label", "small", "zone-")["labels"] == {
        "gpu-class": "t4",
        "simulated": "true",
        **pythons,
    }
    assert ok_json(env, "nodes", "taint", "big", "reserved=db")["taints"] == {"reserved": "db"}

    # general work keeps off the tainted node; `cpool explain` says why a selector for it waits
    waits = ok_json(env, "alloc", "--gpus", "1", "--node-selector", "gpu-class=a100", "--no-wait")
    wait_for("a scheduling cycle", lambda: api.get(waits["id"])["reason"] not in ("", "queued"), 20)
    r = run(env, "explain", str(waits["id"]))
    assert r.returncode == 0 and "untolerated taint" in r.stdout and "node selector" in r.stdout, r.stdout
    tolerant = ok_json(
        env, "alloc", "--gpus", "1", "--node-selector", "gpu-class=a100", "--toleration", "reserved=db",
        "--timeout", "30",
    )  # fmt: skip
    assert tolerant["nodes"] == ["big"] and tolerant["request"]["tolerations"] == ["reserved=db"]
    for a in (waits, tolerant):
        run(env, "cancel", str(a["id"]))

    # a node dedicated without lending: others' work waits there, and explain names the cause
    api.http.post("/api/v1/tenants", json={"name": "ml", "weight": 1.0}).raise_for_status()
    out = ok_json(env, "nodes", "dedicate", "small", "--tenant", "ml", "--no-lending")
    assert out["dedicated_to"] == "ml" and out["lending"] is False
    listing = run(env, "nodes")
    assert "dedicated to ml (no lending)" in listing.stdout, listing.stdout
    other = ok_json(env, "alloc", "--gpus", "1", "--node-selector", "gpu-class=t4", "--no-wait")
    wait_for("a scheduling cycle", lambda: api.get(other["id"])["reason"] not in ("", "queued"), 20)
    r = run(env, "explain", str(other["id"]))
    assert "dedicated to another tenant" in r.stdout, r.stdout
    assert ok_json(env, "nodes", "undedicate", "small")["dedicated"] is False
    wait_for("bound once the node is shared", lambda: api.state(other["id"]) == "bound", 20)
    run(env, "cancel", str(other["id"]))


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("nodes", "label", "small", "no-equals-sign"), "labels"),
        (("nodes", "taint", "small", "bad key!=x"), "taints"),
        (("nodes", "dedicate", "small", "--tenant", "nobody"), "dedicated_to"),
        (("nodes", "label", "no-such-node", "a=b"), "node"),
        (("alloc", "--gpus", "1", "--toleration", "=x"), "--toleration"),
        (("alloc", "--gpus", "1", "--toleration", "a=b=c", "--no-wait"), "tolerations"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(
    pool: tuple[Pool, dict[str, str]], args: tuple[str, ...], field: str
) -> None:
    _, env = pool
    r = run(env, *args)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and field in lines[0], r.stderr
